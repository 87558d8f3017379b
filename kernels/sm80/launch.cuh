// The sm80 family's launches, shared by its translation units
// (kernels/sm80/prefill.cu: 16-bit pools and the entry points;
// kernels/sm80/prefill_fp8.cu: FP8 pools): the run-time (head_dim, tile,
// dtype) turned into the kernel's compile-time shape, and its occupancy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/kv_geometry.h"
#include "kernels/sm80/prefill_kernel.cuh"

namespace attnserve {
namespace sm80 {

template <int D, int MT, int KB, typename T, bool kFp8>
cudaError_t Launch(const PrefillKernelArgs& args, int32_t num_items, cudaStream_t stream) {
  using Tr = Traits<D, MT, KB, kFp8>;
  auto kernel = PagedPrefillKernel<D, MT, KB, T, kFp8>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<num_items, Tr::kThreads, Tr::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

template <int D, int MT, int KB, typename T, bool kFp8>
int32_t CtasPerSm() {
  using Tr = Traits<D, MT, KB, kFp8>;
  auto kernel = PagedPrefillKernel<D, MT, KB, T, kFp8>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes) != cudaSuccess) return 1;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Tr::kThreads, Tr::kSmemBytes) != cudaSuccess) return 1;
  return std::max(n, 1);
}

// (head_dim, rows64) -> <D, MT (16-row MMA tiles per warp), KB (K/V block)>;
// the tile rows match PrefillTileRows in kernels/plan/kernel_select.cc.
#define ATTNSERVE_SM80_SHAPE(head_dim, rows64, FN, F8, ...)                    \
  if ((head_dim) == 64) return FN<64, 2, 64, T, F8>(__VA_ARGS__);              \
  if ((head_dim) == 128 && (rows64)) return FN<128, 1, 64, T, F8>(__VA_ARGS__); \
  if ((head_dim) == 128) return FN<128, 2, 64, T, F8>(__VA_ARGS__);            \
  return FN<256, 1, 32, T, F8>(__VA_ARGS__)
#define ATTNSERVE_SM80_DISPATCH(head_dim, rows64, dtype, FN, F8, ...) \
  [&]() {                                                              \
    if ((dtype) == KvDType::kBf16) {                                   \
      using T = __nv_bfloat16;                                         \
      ATTNSERVE_SM80_SHAPE(head_dim, rows64, FN, F8, __VA_ARGS__);     \
    } else {                                                           \
      using T = __half;                                                \
      ATTNSERVE_SM80_SHAPE(head_dim, rows64, FN, F8, __VA_ARGS__);     \
    }                                                                  \
  }()

static_assert(Traits<64, 2, 64>::kM == 128 && Traits<128, 1, 64>::kM == 64 &&
                  Traits<128, 2, 64>::kM == 128 && Traits<256, 1, 32>::kM == 64,
              "tile rows must match PrefillTileRows (kernels/plan/kernel_select.cc)");

// kernels/sm80/prefill_fp8.cu: the FP8 pools' kernels.
cudaError_t LaunchFp8(const PrefillKernelArgs& args, int32_t num_items, bool rows64, cudaStream_t stream);
int32_t Fp8CtasPerSm(int32_t head_dim, KvDType dtype, bool rows64);

}  // namespace sm80
}  // namespace attnserve
