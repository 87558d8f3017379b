#include "kernels/plan/kernel_select.h"

#include <cstring>

namespace attnserve {

const char* PrefillKernelName(PrefillKernel kernel) {
  switch (kernel) {
    case PrefillKernel::kSm80:
      return "sm80";
    case PrefillKernel::kSm80Rows64:
      return "sm80_rows64";
    case PrefillKernel::kSm90:
      return "sm90";
    case PrefillKernel::kSm90Overlap:
      return "sm90_overlap";
    case PrefillKernel::kSm90OverlapNoPp:
      return "sm90_overlap_nopp";
    case PrefillKernel::kSm90Fp8Q:
      return "sm90_fp8q";
  }
  return "unknown";
}

int32_t PrefillTileRows(PrefillKernel kernel, int32_t head_dim) {
  // sm90: 2 consumer warpgroups x 64 rows (kernels/sm90/traits.cuh).
  if (IsSm90Kernel(kernel)) return 128;
  // sm80: 4 warps x 16 rows x MMA tiles per warp (kernels/sm80/traits.cuh).
  if (head_dim == 256) return 64;
  if (kernel == PrefillKernel::kSm80Rows64 && head_dim == 128) return 64;
  return 128;
}

bool ParsePrefillFamily(const char* text, PrefillFamily* family) {
  if (std::strcmp(text, "auto") == 0) {
    *family = PrefillFamily::kAuto;
  } else if (std::strcmp(text, "sm80") == 0) {
    *family = PrefillFamily::kSm80;
  } else if (std::strcmp(text, "sm90") == 0) {
    *family = PrefillFamily::kSm90;
  } else if (std::strcmp(text, "sm90_fp8q") == 0) {
    *family = PrefillFamily::kSm90Fp8Q;
  } else {
    return false;
  }
  return true;
}

const char* PrefillFamilyName(PrefillFamily family) {
  switch (family) {
    case PrefillFamily::kAuto:
      return "auto";
    case PrefillFamily::kSm80:
      return "sm80";
    case PrefillFamily::kSm90:
      return "sm90";
    case PrefillFamily::kSm90Fp8Q:
      return "sm90_fp8q";
  }
  return "unknown";
}

bool PrefillFamilyRunsOn(PrefillFamily family, const PrefillDevice& device) {
  return (family != PrefillFamily::kSm90 && family != PrefillFamily::kSm90Fp8Q) || device.sm_major == 9;
}

bool PrefillFamilyFitsGeometry(PrefillFamily family, const KvGeometry& geo, const char** why) {
  if (family != PrefillFamily::kSm90Fp8Q) return true;
  if (!geo.KvIsFp8()) {
    *why = "needs --kv_dtype=fp8_e4m3 or fp8_e5m2 (it reads K's stored FP8 bytes)";
    return false;
  }
  if (geo.head_dim != 128) {
    *why = "needs --head_dim=128";
    return false;
  }
  return true;
}

PrefillKernel ChoosePrefillKernel(const KvGeometry& geo, const PrefillDevice& device,
                                  int64_t max_packed_rows, PrefillFamily family, int64_t mean_kv_per_row) {
  const bool sm90_shape = geo.head_dim == 64 || geo.head_dim == 128;
  if (family == PrefillFamily::kSm90Fp8Q && geo.KvIsFp8() && geo.head_dim == 128) {
    return PrefillKernel::kSm90Fp8Q;
  }
  if ((family == PrefillFamily::kSm90 || family == PrefillFamily::kSm90Fp8Q) && sm90_shape) {
    return PrefillKernel::kSm90Overlap;
  }
  // FP8 pools on Hopper: kSm90Overlap at every length (kernel_select.h).
  if (family == PrefillFamily::kAuto && geo.KvIsFp8() && device.sm_major == 9 && sm90_shape) {
    return PrefillKernel::kSm90Overlap;
  }
  // 64-row tiles when no sequence fills more (decode): half the CTA's rows
  // would be idle in a 128-row tile, and twice the CTAs share the batch.
  if (geo.head_dim == 128 && max_packed_rows <= PrefillTileRows(PrefillKernel::kSm80Rows64, 128)) {
    return PrefillKernel::kSm80Rows64;
  }
  if (family == PrefillFamily::kAuto && device.sm_major == 9 && sm90_shape && mean_kv_per_row >= kAutoSm90MinMeanKv) {
    return PrefillKernel::kSm90Overlap;
  }
  return PrefillKernel::kSm80;
}

}  // namespace attnserve
