#include "kernels/plan/kernel_select.h"

namespace attnserve {

const char* PrefillKernelName(PrefillKernel kernel) {
  switch (kernel) {
    case PrefillKernel::kSm80:
      return "sm80";
    case PrefillKernel::kSm80Rows64:
      return "sm80_rows64";
  }
  return "unknown";
}

int32_t PrefillTileRows(PrefillKernel kernel, int32_t head_dim) {
  // 4 warps x 16 rows x MMA tiles per warp (kernels/sm80/traits.cuh).
  if (head_dim == 256) return 64;
  if (kernel == PrefillKernel::kSm80Rows64 && head_dim == 128) return 64;
  return 128;
}

PrefillKernel ChoosePrefillKernel(const KvGeometry& geo, const PrefillDevice& /*device*/,
                                  int64_t max_packed_rows) {
  // 64-row tiles when no sequence fills more (decode): half the CTA's rows
  // would be idle in a 128-row tile, and twice the CTAs share the batch.
  if (geo.head_dim == 128 && max_packed_rows <= PrefillTileRows(PrefillKernel::kSm80Rows64, 128)) {
    return PrefillKernel::kSm80Rows64;
  }
  return PrefillKernel::kSm80;
}

}  // namespace attnserve
