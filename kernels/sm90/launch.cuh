// The sm90 family's kernels as launches: the run-time choice of kernel
// (schedule, tensor copies, soft-caps, sinks, FP8 pools) turned into its
// instantiation, and the grid. Shared by kernels/sm90/prefill.cu (16-bit
// pools) and kernels/sm90/prefill_fp8.cu (FP8 pools, their own translation
// unit so that the two build side by side).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/sm90/prefill_kernel.cuh"

namespace attnserve {
namespace sm90 {

// Variant V (Sm90Variant's value) -> the kernel and its Traits; kTma: the
// overlapped schedule with tensor-copy-engine loads (Traits::kTma); kCap,
// kSinks: with soft-caps, sinks (Traits; only kOverlap, the serving kernel,
// has instantiations without them, the others always carry both); kFp8: on
// FP8 pools (Traits::kFp8, kOverlap only); kFp8Q: S = Q K^T in FP8 on K
// stored in that format (Traits::kFp8Q; kNone: not).
template <int D, typename T, int V, bool kTma = false, bool kCap = true, bool kSinks = true, bool kFp8 = false,
          bool kTrace = false, Fp8Format kFp8Q = Fp8Format::kNone>
struct Kernel {
  static_assert((kCap && kSinks) || V == 1, "only kOverlap has kernels without soft-caps or sinks");
  static_assert(!kFp8 || V == 1, "FP8 pools run on kOverlap");
  using Tr = Traits<D, V == 0 ? Schedule::kSerial : Schedule::kOverlap, V != 2, kTma, kCap, kSinks, kFp8, kFp8Q>;
  static auto Get() {
    if constexpr (V == 0) {
      return PagedPrefillSm90Kernel<D, T>;
    } else {
      return PagedPrefillSm90OverlapKernel<D, T, V == 1, kTrace, kTma, kCap, kSinks, kFp8, kFp8Q>;
    }
  }
};

// CTAs of a launch over num_items items: one per item, or for a persistent
// kernel (Traits::kPersistent, one CTA per SM) at most one per SM and at
// most max_ctas (PagedPrefillParams).
inline int32_t GridSize(bool persistent, int32_t num_items, int32_t max_ctas) {
  if (!persistent) return num_items;
  int dev = 0, sms = 0;
  int32_t grid = num_items;
  if (cudaGetDevice(&dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && sms > 0) {
    grid = std::min(grid, sms);
  }
  if (max_ctas > 0) grid = std::min(grid, max_ctas);
  return grid;
}

template <int D, typename T, int V, bool kTma, bool kCap = true, bool kSinks = true, bool kFp8 = false,
          bool kTrace = false, Fp8Format kFp8Q = Fp8Format::kNone>
cudaError_t LaunchKernel(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  using K = Kernel<D, T, V, kTma, kCap, kSinks, kFp8, kTrace, kFp8Q>;
  using Tr = typename K::Tr;
  auto kernel = K::Get();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<GridSize(Tr::kPersistent, args.num_items, max_ctas), Tr::kThreads, Tr::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// kOverlap on 16-bit pools loads K and V by the tensor copy engine when the
// caches' tensor maps could be made (args.tma_run > 0), the other variants
// by cp.async; it runs the leanest of its kernels the batch allows: without
// the soft-cap's code when no sequence has one, without the sinks' too when
// the batch has no sink set.
template <int D, typename T, bool kTma>
cudaError_t LaunchOverlap(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  if (args.p.any_soft_cap) return LaunchKernel<D, T, 1, kTma, true, true>(args, max_ctas, stream);
  if (args.p.sinks != nullptr) return LaunchKernel<D, T, 1, kTma, false, true>(args, max_ctas, stream);
  return LaunchKernel<D, T, 1, kTma, false, false>(args, max_ctas, stream);
}

// kOverlap on FP8 pools (kernels/sm90/prefill_fp8.cu): with or without the
// soft-cap's code (the sinks' costs nothing measurable there: their code is
// the epilogue's).
cudaError_t LaunchOverlapFp8(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream);
// kOverlap with S = Q K^T in FP8 (kernels/sm90/prefill_fp8q.cu; head_dim 128,
// E4M3 or E5M2 pools): with or without the soft-cap's code.
cudaError_t LaunchOverlapFp8Q(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream);
// Its traced kernel (PagedPrefillSm90Traced; head_dim 128, bf16 queries, no
// soft-cap or sinks).
cudaError_t LaunchTracedFp8(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream);

}  // namespace sm90
}  // namespace attnserve
