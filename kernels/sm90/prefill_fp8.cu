// The sm90 family's kernels on FP8 pools (Traits::kFp8): kOverlap, with or
// without tensor copies and the soft-cap's code, for head_dim 64 and 128 and
// bf16 or fp16 queries. A translation unit of their own, built beside
// kernels/sm90/prefill.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/sm90/launch.cuh"

namespace attnserve {
namespace sm90 {
namespace {

template <int D, typename T, bool kTma>
cudaError_t LaunchFp8(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  if (args.p.any_soft_cap) return LaunchKernel<D, T, 1, kTma, true, true, true>(args, max_ctas, stream);
  return LaunchKernel<D, T, 1, kTma, false, true, true>(args, max_ctas, stream);
}

template <int D, typename T>
cudaError_t LaunchFp8(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  return args.tma_run > 0 ? LaunchFp8<D, T, true>(args, max_ctas, stream)
                          : LaunchFp8<D, T, false>(args, max_ctas, stream);
}

template <typename T>
cudaError_t LaunchFp8(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  return args.p.geo.head_dim == 64 ? LaunchFp8<64, T>(args, max_ctas, stream)
                                   : LaunchFp8<128, T>(args, max_ctas, stream);
}

}  // namespace

cudaError_t LaunchOverlapFp8(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  if (args.p.geo.dtype == KvDType::kBf16) return LaunchFp8<__nv_bfloat16>(args, max_ctas, stream);
  return LaunchFp8<__half>(args, max_ctas, stream);
}

cudaError_t LaunchTracedFp8(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  return LaunchKernel<128, __nv_bfloat16, 1, true, false, false, true, /*kTrace=*/true>(args, max_ctas, stream);
}

}  // namespace sm90
}  // namespace attnserve
