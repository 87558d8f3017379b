// KV append and gather: one thread per 16-byte chunk of a row (8 bf16/fp16
// elements) of K and of V; rows of num_kv_heads * head_dim elements.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/kv/kv_rows_cuda.h"

namespace attnserve {
namespace {

// ELEMS: 16-bit elements per thread: 8 (16-byte accesses) or 1.
template <int ELEMS, bool SCATTER>
__global__ void __launch_bounds__(256)
    CopyRowsKernel(uint16_t* cache_k, uint16_t* cache_v, uint16_t* rows_k, uint16_t* rows_v,
                   const int64_t* slots, int64_t n, int64_t row_elems, int64_t layer_slot0) {
  using V = typename std::conditional<ELEMS == 8, uint4, uint16_t>::type;
  const int64_t chunks = row_elems / ELEMS;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t i = idx / chunks;
  if (i >= n) return;
  const int64_t c = idx - i * chunks;
  const int64_t cache_off = (layer_slot0 + slots[i]) * row_elems + c * ELEMS;
  const int64_t row_off = i * row_elems + c * ELEMS;
  if (SCATTER) {
    *reinterpret_cast<V*>(cache_k + cache_off) = *reinterpret_cast<const V*>(rows_k + row_off);
    *reinterpret_cast<V*>(cache_v + cache_off) = *reinterpret_cast<const V*>(rows_v + row_off);
  } else {
    *reinterpret_cast<V*>(rows_k + row_off) = *reinterpret_cast<const V*>(cache_k + cache_off);
    *reinterpret_cast<V*>(rows_v + row_off) = *reinterpret_cast<const V*>(cache_v + cache_off);
  }
}

template <bool SCATTER>
cudaError_t Launch(void* cache_k, void* cache_v, void* k, void* v, const int64_t* slots, int64_t n,
                   int32_t layer, const KvGeometry& geo, cudaStream_t stream) {
  const int64_t row_elems = geo.RowElems();
  if (n == 0 || row_elems == 0) return cudaSuccess;
  const int64_t layer_slot0 = int64_t{layer} * geo.SlotsPerLayer();
  auto* ck = static_cast<uint16_t*>(cache_k);
  auto* cv = static_cast<uint16_t*>(cache_v);
  auto* rk = static_cast<uint16_t*>(k);
  auto* rv = static_cast<uint16_t*>(v);
  if (row_elems % 8 == 0) {
    const int64_t blocks = (n * (row_elems / 8) + 255) / 256;
    CopyRowsKernel<8, SCATTER><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        ck, cv, rk, rv, slots, n, row_elems, layer_slot0);
  } else {
    const int64_t blocks = (n * row_elems + 255) / 256;
    CopyRowsKernel<1, SCATTER><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        ck, cv, rk, rv, slots, n, row_elems, layer_slot0);
  }
  return cudaGetLastError();
}

// One block per (listed page, layer): a page of one layer is contiguous,
// page_bytes of K and the same of V (a multiple of 16: head_dim % 8 == 0).
__global__ void __launch_bounds__(256)
    ZeroPagesKernel(uint4* cache_k, uint4* cache_v, const int32_t* pages, int64_t num_listed,
                    int64_t page_chunks, int64_t layer_chunks) {
  const int64_t layer = blockIdx.y;
  for (int64_t i = blockIdx.x; i < num_listed; i += gridDim.x) {
    const int64_t base = layer * layer_chunks + int64_t{pages[i]} * page_chunks;
    for (int64_t c = threadIdx.x; c < page_chunks; c += blockDim.x) {
      cache_k[base + c] = make_uint4(0, 0, 0, 0);
      cache_v[base + c] = make_uint4(0, 0, 0, 0);
    }
  }
}

}  // namespace

cudaError_t ZeroPagesCuda(const ZeroPagesParams& p, cudaStream_t stream) {
  const KvGeometry& g = p.geo;
  if (p.num_pages_listed == 0 || g.num_layers == 0) return cudaSuccess;
  const int64_t page_bytes = int64_t{g.page_size} * g.RowElems() * 2;
  if (page_bytes % 16 != 0 || g.num_layers > 65535) return cudaErrorInvalidValue;
  const int64_t page_chunks = page_bytes / 16;
  const int64_t layer_chunks = int64_t{g.num_pages} * page_chunks;
  const unsigned blocks_x = static_cast<unsigned>(std::min<int64_t>(p.num_pages_listed, 1 << 16));
  ZeroPagesKernel<<<dim3(blocks_x, static_cast<unsigned>(g.num_layers)), 256, 0, stream>>>(
      static_cast<uint4*>(p.k_cache), static_cast<uint4*>(p.v_cache), p.pages, p.num_pages_listed,
      page_chunks, layer_chunks);
  return cudaGetLastError();
}

cudaError_t AppendKvCuda(const AppendKvParams& p, cudaStream_t stream) {
  return Launch<true>(p.k_cache, p.v_cache, const_cast<void*>(p.k), const_cast<void*>(p.v),
                      p.slots, p.n, p.layer, p.geo, stream);
}

cudaError_t GatherKvCuda(const GatherKvParams& p, cudaStream_t stream) {
  return Launch<false>(const_cast<void*>(p.k_cache), const_cast<void*>(p.v_cache), p.k, p.v,
                       p.slots, p.n, p.layer, p.geo, stream);
}

}  // namespace attnserve
