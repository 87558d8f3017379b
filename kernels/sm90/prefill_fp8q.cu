// The sm90 family's kernels with FP8 queries (Traits::kFp8Q,
// PrefillKernel::kSm90Fp8Q): kOverlap on E4M3 or E5M2 pools at head_dim 128,
// with or without tensor copies and the soft-cap's code, for bf16 or fp16
// queries. A translation unit of their own, built beside
// kernels/sm90/prefill_fp8.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/sm90/launch.cuh"

namespace attnserve {
namespace sm90 {
namespace {

template <typename T, bool kTma, Fp8Format kK>
cudaError_t LaunchFp8Q(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  if (args.p.any_soft_cap) return LaunchKernel<128, T, 1, kTma, true, true, true, false, kK>(args, max_ctas, stream);
  return LaunchKernel<128, T, 1, kTma, false, true, true, false, kK>(args, max_ctas, stream);
}

template <typename T, Fp8Format kK>
cudaError_t LaunchFp8Q(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  return args.tma_run > 0 ? LaunchFp8Q<T, true, kK>(args, max_ctas, stream)
                          : LaunchFp8Q<T, false, kK>(args, max_ctas, stream);
}

template <typename T>
cudaError_t LaunchFp8Q(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  return args.p.geo.kv_fp8 == Fp8Format::kE5m2 ? LaunchFp8Q<T, Fp8Format::kE5m2>(args, max_ctas, stream)
                                               : LaunchFp8Q<T, Fp8Format::kE4m3>(args, max_ctas, stream);
}

}  // namespace

cudaError_t LaunchOverlapFp8Q(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  if (args.p.geo.head_dim != 128 || !args.p.geo.KvIsFp8()) return cudaErrorInvalidValue;
  if (args.p.geo.dtype == KvDType::kBf16) return LaunchFp8Q<__nv_bfloat16>(args, max_ctas, stream);
  return LaunchFp8Q<__half>(args, max_ctas, stream);
}

}  // namespace sm90
}  // namespace attnserve
