// The sm90 family's launches: the run-time (head_dim, dtype, variant) turned
// into the kernel's compile-time shape and schedule, the device check, and
// the occupancy.
#include "kernels/sm90/prefill_sm90.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/sm90/prefill_kernel.cuh"

namespace attnserve {
namespace {

using sm90::PagedPrefillSm90Kernel;
using sm90::PagedPrefillSm90OverlapKernel;
using sm90::PrefillKernelArgs;
using sm90::Schedule;
using sm90::Traits;

// Variant V (Sm90Variant's value) -> the kernel and its Traits.
template <int D, typename T, int V>
struct Kernel {
  using Tr = Traits<D, V == 0 ? Schedule::kSerial : Schedule::kOverlap, V != 2>;
  static auto Get() {
    if constexpr (V == 0) {
      return PagedPrefillSm90Kernel<D, T>;
    } else {
      return PagedPrefillSm90OverlapKernel<D, T, V == 1>;
    }
  }
};
static_assert(static_cast<int>(Sm90Variant::kSerial) == 0 && static_cast<int>(Sm90Variant::kOverlap) == 1 &&
                  static_cast<int>(Sm90Variant::kOverlapNoPingPong) == 2,
              "Kernel<D, T, V> numbers the variants");

template <int D, typename T, int V>
cudaError_t Launch(const PrefillKernelArgs& args, int32_t num_items, cudaStream_t stream) {
  using Tr = typename Kernel<D, T, V>::Tr;
  auto kernel = Kernel<D, T, V>::Get();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<num_items, Tr::kThreads, Tr::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

template <int D, typename T, int V>
int32_t CtasPerSm() {
  using Tr = typename Kernel<D, T, V>::Tr;
  auto kernel = Kernel<D, T, V>::Get();
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes) != cudaSuccess) {
    return 1;
  }
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Tr::kThreads, Tr::kSmemBytes) != cudaSuccess) {
    return 1;
  }
  return std::max(n, 1);
}

#define ATTNSERVE_SM90_DISPATCH_V(head_dim, dtype, V, FN, ...)    \
  [&]() {                                                         \
    if ((dtype) == KvDType::kBf16) {                              \
      using T = __nv_bfloat16;                                    \
      if ((head_dim) == 64) return FN<64, T, V>(__VA_ARGS__);     \
      return FN<128, T, V>(__VA_ARGS__);                          \
    }                                                             \
    using T = __half;                                             \
    if ((head_dim) == 64) return FN<64, T, V>(__VA_ARGS__);       \
    return FN<128, T, V>(__VA_ARGS__);                            \
  }()

#define ATTNSERVE_SM90_DISPATCH(head_dim, dtype, variant, FN, ...)                  \
  [&]() {                                                                           \
    switch (variant) {                                                              \
      case Sm90Variant::kOverlap:                                                   \
        return ATTNSERVE_SM90_DISPATCH_V(head_dim, dtype, 1, FN, __VA_ARGS__);      \
      case Sm90Variant::kOverlapNoPingPong:                                         \
        return ATTNSERVE_SM90_DISPATCH_V(head_dim, dtype, 2, FN, __VA_ARGS__);      \
      case Sm90Variant::kSerial:                                                    \
        break;                                                                      \
    }                                                                               \
    return ATTNSERVE_SM90_DISPATCH_V(head_dim, dtype, 0, FN, __VA_ARGS__);          \
  }()

static_assert(Traits<64>::kM == 128 && Traits<128>::kM == 128,
              "tile rows must match PrefillTileRows (kernels/plan/kernel_select.cc)");

}  // namespace

bool Sm90PrefillSupported() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  return major == 9;
}

int32_t Sm90PrefillCtasPerSm(int32_t head_dim, KvDType dtype, Sm90Variant variant) {
  if (head_dim != 64 && head_dim != 128) return 1;
  if (!Sm90PrefillSupported()) return 1;
  return ATTNSERVE_SM90_DISPATCH(head_dim, dtype, variant, CtasPerSm);
}

cudaError_t PagedPrefillSm90(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse, Sm90Variant variant,
                             cudaStream_t stream) {
  const KvGeometry& geo = params.geo;
  if (geo.head_dim != 64 && geo.head_dim != 128) return cudaErrorInvalidValue;
  if (geo.num_kv_heads <= 0 || geo.num_qo_heads % geo.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (!Sm90PrefillSupported()) return cudaErrorNotSupported;
  if (num_items == 0) return cudaSuccess;
  PrefillKernelArgs args;
  args.q = params.q;
  args.o = params.o;
  args.lse = params.lse;
  args.k_cache = params.k_cache;
  args.v_cache = params.v_cache;
  args.kv_indices = params.kv_indices;
  args.seqs = params.seqs;
  args.items = items;
  args.part_o = part_o;
  args.part_lse = part_lse;
  args.num_qo_heads = geo.num_qo_heads;
  args.num_kv_heads = geo.num_kv_heads;
  args.page_size = geo.page_size;
  args.slots_per_layer = geo.SlotsPerLayer();
  return ATTNSERVE_SM90_DISPATCH(geo.head_dim, geo.dtype, variant, Launch, args, num_items, stream);
}

}  // namespace attnserve
