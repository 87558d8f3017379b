// The sm80 family's launches: the run-time (head_dim, tile, dtype) turned
// into the kernel's compile-time shape, and its occupancy.
#include "kernels/sm80/prefill_sm80.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/plan/kernel_select.h"
#include "kernels/sm80/prefill_kernel.cuh"

namespace attnserve {
namespace {

using sm80::PagedPrefillKernel;
using sm80::PrefillKernelArgs;
using sm80::Traits;

template <int D, int MT, int KB, typename T>
cudaError_t Launch(const PrefillKernelArgs& args, int32_t num_items, cudaStream_t stream) {
  using Tr = Traits<D, MT, KB>;
  auto kernel = PagedPrefillKernel<D, MT, KB, T>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<num_items, Tr::kThreads, Tr::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

template <int D, int MT, int KB, typename T>
int32_t CtasPerSm() {
  using Tr = Traits<D, MT, KB>;
  auto kernel = PagedPrefillKernel<D, MT, KB, T>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes) != cudaSuccess) return 1;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Tr::kThreads, Tr::kSmemBytes) != cudaSuccess) return 1;
  return std::max(n, 1);
}

// (head_dim, rows64) -> <D, MT (16-row MMA tiles per warp), KB (K/V block)>;
// the tile rows match PrefillTileRows in kernels/plan/kernel_select.cc.
#define ATTNSERVE_SM80_SHAPE(head_dim, rows64, FN, ...)                  \
  if ((head_dim) == 64) return FN<64, 2, 64, T>(__VA_ARGS__);            \
  if ((head_dim) == 128 && (rows64)) return FN<128, 1, 64, T>(__VA_ARGS__); \
  if ((head_dim) == 128) return FN<128, 2, 64, T>(__VA_ARGS__);          \
  return FN<256, 1, 32, T>(__VA_ARGS__)
#define ATTNSERVE_SM80_DISPATCH(head_dim, rows64, dtype, FN, ...)        \
  [&]() {                                                                 \
    if ((dtype) == KvDType::kBf16) {                                      \
      using T = __nv_bfloat16;                                            \
      ATTNSERVE_SM80_SHAPE(head_dim, rows64, FN, __VA_ARGS__);            \
    } else {                                                              \
      using T = __half;                                                   \
      ATTNSERVE_SM80_SHAPE(head_dim, rows64, FN, __VA_ARGS__);            \
    }                                                                     \
  }()

static_assert(Traits<64, 2, 64>::kM == 128 && Traits<128, 1, 64>::kM == 64 &&
                  Traits<128, 2, 64>::kM == 128 && Traits<256, 1, 32>::kM == 64,
              "tile rows must match PrefillTileRows (kernels/plan/kernel_select.cc)");

}  // namespace

int32_t Sm80PrefillCtasPerSm(int32_t head_dim, KvDType dtype, bool rows64) {
  if (!IsSupportedHeadDim(head_dim)) return 1;
  return ATTNSERVE_SM80_DISPATCH(head_dim, rows64, dtype, CtasPerSm);
}

cudaError_t PagedPrefillSm80(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse, bool rows64,
                             cudaStream_t stream) {
  const KvGeometry& geo = params.geo;
  // 16-bit pools only: FP8 pools run on the decode family (CutForDecode).
  if (geo.KvIsFp8()) return cudaErrorInvalidValue;
  if (!IsSupportedHeadDim(geo.head_dim)) return cudaErrorInvalidValue;
  if (geo.num_kv_heads <= 0 || geo.num_qo_heads % geo.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (num_items == 0) return cudaSuccess;
  PrefillKernelArgs args;
  args.p = params;
  args.items = items;
  args.part_o = part_o;
  args.part_lse = part_lse;
  args.slots_per_layer = geo.SlotsPerLayer();
  return ATTNSERVE_SM80_DISPATCH(geo.head_dim, rows64, geo.dtype, Launch, args, num_items, stream);
}

}  // namespace attnserve
