// The sm80 family's entry points and its kernels on 16-bit pools (those on
// FP8 pools are built in kernels/sm80/prefill_fp8.cu; the dispatch from
// run-time shapes to kernels is kernels/sm80/launch.cuh).
#include "kernels/sm80/prefill_sm80.h"

#include "kernels/plan/kernel_select.h"
#include "kernels/sm80/launch.cuh"

namespace attnserve {

using sm80::PrefillKernelArgs;

int32_t Sm80PrefillCtasPerSm(int32_t head_dim, KvDType dtype, bool rows64, Fp8Format kv_fp8) {
  if (!IsSupportedHeadDim(head_dim)) return 1;
  if (kv_fp8 != Fp8Format::kNone) return sm80::Fp8CtasPerSm(head_dim, dtype, rows64);
  return ATTNSERVE_SM80_DISPATCH(head_dim, rows64, dtype, sm80::CtasPerSm, false);
}

cudaError_t PagedPrefillSm80(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse, bool rows64,
                             cudaStream_t stream) {
  const KvGeometry& geo = params.geo;
  if (!IsSupportedHeadDim(geo.head_dim)) return cudaErrorInvalidValue;
  if (geo.num_kv_heads <= 0 || geo.num_qo_heads % geo.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (num_items == 0) return cudaSuccess;
  PrefillKernelArgs args;
  args.p = params;
  args.items = items;
  args.part_o = part_o;
  args.part_lse = part_lse;
  args.slots_per_layer = geo.SlotsPerLayer();
  if (geo.KvIsFp8()) return sm80::LaunchFp8(args, num_items, rows64, stream);
  return ATTNSERVE_SM80_DISPATCH(geo.head_dim, rows64, geo.dtype, sm80::Launch, false, args, num_items, stream);
}

}  // namespace attnserve
