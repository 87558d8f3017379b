// The sm80 family's kernels on FP8 pools (Traits::kFp8): every shape, bf16
// or fp16 queries. A translation unit of their own, built beside
// kernels/sm80/prefill.cu.
#include "kernels/sm80/launch.cuh"

namespace attnserve {
namespace sm80 {

cudaError_t LaunchFp8(const PrefillKernelArgs& args, int32_t num_items, bool rows64, cudaStream_t stream) {
  return ATTNSERVE_SM80_DISPATCH(args.p.geo.head_dim, rows64, args.p.geo.dtype, Launch, true, args, num_items,
                                 stream);
}

int32_t Fp8CtasPerSm(int32_t head_dim, KvDType dtype, bool rows64) {
  return ATTNSERVE_SM80_DISPATCH(head_dim, rows64, dtype, CtasPerSm, true);
}

}  // namespace sm80
}  // namespace attnserve
