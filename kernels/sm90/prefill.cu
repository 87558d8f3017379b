// The sm90 family's launches: the run-time (head_dim, dtype, variant) turned
// into the kernel's compile-time shape and schedule, the device check, and
// the occupancy.
#include "kernels/sm90/prefill_sm90.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cuda.h>  // the tensor-map types and enums (no libcuda link)

#include <algorithm>
#include <cstring>

#include "kernels/plan/kernel_select.h"
#include "kernels/sm90/launch.cuh"

namespace attnserve {
namespace {

using sm90::GridSize;
using sm90::Kernel;
using sm90::LaunchKernel;
using sm90::LaunchOverlap;
using sm90::PagedPrefillSm90OverlapKernel;
using sm90::PrefillKernelArgs;
using sm90::Schedule;
using sm90::Traits;

static_assert(static_cast<int>(Sm90Variant::kSerial) == 0 && static_cast<int>(Sm90Variant::kOverlap) == 1 &&
                  static_cast<int>(Sm90Variant::kOverlapNoPingPong) == 2,
              "Kernel<D, T, V> numbers the variants");

template <int D, typename T, int V>
cudaError_t Launch(const PrefillKernelArgs& args, int32_t max_ctas, cudaStream_t stream) {
  if constexpr (V == 1) {
    return args.tma_run > 0 ? LaunchOverlap<D, T, true>(args, max_ctas, stream)
                            : LaunchOverlap<D, T, false>(args, max_ctas, stream);
  }
  return LaunchKernel<D, T, V, false>(args, max_ctas, stream);
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
      case Sm90Variant::kOverlapFp8Q:                                               \
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

namespace {

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link
// against libcuda); null when the driver does not offer it.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled GetEncodeTiled() {
  static const EncodeTiled fn = []() -> EncodeTiled {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A cache's tensor map: (head_dim, KV heads, slots of every layer), boxes of
// 64 elements x 1 head x `rows` rows, 128-byte swizzled as the kernel's tiles
// (TileOff), zeros outside. An FP8 cache's boxes are whole rows of
// head_dim bytes, 128-byte swizzled at head_dim 128 and dense at 64, as the
// kernel's FP8 staging (Fp8Off), which it converts in place.
bool EncodeCacheMap(const void* cache, const KvGeometry& geo, int rows, CUtensorMap* map) {
  const EncodeTiled encode = GetEncodeTiled();
  if (encode == nullptr) return false;
  const bool fp8 = geo.KvIsFp8();
  const cuuint64_t elem = fp8 ? 1 : 2;
  const cuuint64_t dims[3] = {cuuint64_t(geo.head_dim), cuuint64_t(geo.num_kv_heads),
                              cuuint64_t(geo.SlotsPerLayer() * geo.num_layers)};
  const cuuint64_t strides[2] = {cuuint64_t(geo.head_dim) * elem,
                                 cuuint64_t(geo.num_kv_heads) * geo.head_dim * elem};
  const cuuint32_t box[3] = {fp8 ? cuuint32_t(geo.head_dim) : 64u, 1, cuuint32_t(rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUtensorMapDataType type = fp8                           ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : geo.dtype == KvDType::kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 3, const_cast<void*>(cache), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                fp8 && geo.head_dim == 64 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The K and V tensor maps for Traits::kTma, kept per thread for the last
// caches and geometry (a server launches on the same caches every time).
// Leaves args->tma_run 0 (cp.async alone) for pages of fewer than 8 rows
// (whose boxes would not be 1024-byte aligned in the stage), for batches of
// short sequences on 16-bit pools (Sm90TensorCopies), or when the maps
// cannot be made (the driver lacks the entry point, or the slots of every
// layer do not fit the kernel's 32-bit coordinates).
void SetTmaMaps(const PagedPrefillParams& params, PrefillKernelArgs* args) {
  const KvGeometry& geo = params.geo;
  args->tma_run = 0;
  if (!Sm90TensorCopies(geo, params.mean_kv_per_row)) return;
  const int64_t total_slots = geo.SlotsPerLayer() * geo.num_layers;
  if (total_slots <= 0 || total_slots >= INT32_MAX) return;
  // Rows per box: the largest power of two that divides page_size, at most
  // a block (128 rows).
  const int run = std::min(geo.page_size & -geo.page_size, 128);
  if (run < 8) return;
  struct Cached {
    const void* k = nullptr;
    const void* v = nullptr;
    KvGeometry geo;
    CUtensorMap k_map, v_map;
  };
  thread_local Cached cached;
  const bool same = cached.k == params.k_cache && cached.v == params.v_cache &&
                    std::memcmp(&cached.geo, &geo, sizeof(geo)) == 0;
  if (!same) {
    cached.k = nullptr;
    if (!EncodeCacheMap(params.k_cache, geo, run, &cached.k_map) ||
        !EncodeCacheMap(params.v_cache, geo, run, &cached.v_map)) {
      return;
    }
    cached.k = params.k_cache;
    cached.v = params.v_cache;
    cached.geo = geo;
  }
  args->k_map = cached.k_map;
  args->v_map = cached.v_map;
  args->tma_run = run;
}

// The kernel's arguments, or an error for a geometry the family does not run.
// FP8 pools run on kOverlap only (fp8_overlap).
cudaError_t MakeArgs(const PagedPrefillParams& params, const PrefillWorkItem* items, int32_t num_items,
                     float* part_o, float* part_lse, bool fp8_overlap, PrefillKernelArgs* args) {
  const KvGeometry& geo = params.geo;
  if (geo.KvIsFp8() && !fp8_overlap) return cudaErrorInvalidValue;
  if (geo.head_dim != 64 && geo.head_dim != 128) return cudaErrorInvalidValue;
  if (geo.num_kv_heads <= 0 || geo.num_qo_heads % geo.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (!Sm90PrefillSupported()) return cudaErrorNotSupported;
  *args = PrefillKernelArgs{};
  args->p = params;
  args->items = items;
  args->num_items = num_items;
  args->part_o = part_o;
  args->part_lse = part_lse;
  args->group = FastDiv(geo.num_qo_heads / geo.num_kv_heads);
  args->page = FastDiv(geo.page_size);
  args->slots_per_layer = geo.SlotsPerLayer();
  return cudaSuccess;
}

}  // namespace

cudaError_t PagedPrefillSm90(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse, Sm90Variant variant,
                             cudaStream_t stream) {
  PrefillKernelArgs args;
  const KvGeometry& geo = params.geo;
  const bool fp8_q = variant == Sm90Variant::kOverlapFp8Q;
  // FP8 queries: FP8 pools (E4M3 or E5M2) at head_dim 128 only.
  if (fp8_q && (!geo.KvIsFp8() || geo.head_dim != 128)) return cudaErrorInvalidValue;
  const cudaError_t err =
      MakeArgs(params, items, num_items, part_o, part_lse, variant == Sm90Variant::kOverlap || fp8_q, &args);
  if (err != cudaSuccess || num_items == 0) return err;
  if (variant == Sm90Variant::kOverlap || fp8_q) SetTmaMaps(params, &args);
  if (fp8_q) return sm90::LaunchOverlapFp8Q(args, params.max_ctas, stream);
  if (geo.KvIsFp8()) return sm90::LaunchOverlapFp8(args, params.max_ctas, stream);
  return ATTNSERVE_SM90_DISPATCH(geo.head_dim, geo.dtype, variant, Launch, args, params.max_ctas, stream);
}

cudaError_t PagedPrefillSm90Traced(const PagedPrefillParams& params, const PrefillWorkItem* items,
                                   int32_t num_items, float* part_o, float* part_lse, long long* trace,
                                   int32_t trace_ctas, cudaStream_t stream) {
  if (params.geo.head_dim != 128 || params.geo.dtype != KvDType::kBf16) return cudaErrorInvalidValue;
  // The traced kernel is the lean one.
  if (params.any_soft_cap || params.sinks != nullptr) return cudaErrorInvalidValue;
  PrefillKernelArgs args;
  cudaError_t err = MakeArgs(params, items, num_items, part_o, part_lse, /*fp8_overlap=*/true, &args);
  if (err != cudaSuccess || num_items == 0) return err;
  args.trace = trace;
  args.trace_ctas = trace_ctas;
  SetTmaMaps(params, &args);
  if (params.geo.KvIsFp8()) return sm90::LaunchTracedFp8(args, params.max_ctas, stream);
  return LaunchKernel<128, __nv_bfloat16, 1, true, false, false, false, /*kTrace=*/true>(args, params.max_ctas, stream);
}

}  // namespace attnserve
