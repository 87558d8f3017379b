// KV append and gather: one thread per 16-byte chunk of a row of K and of V
// (rows of num_kv_heads * head_dim elements; K's alone on an MLA pool, whose
// V cache pointer is null), and on FP8 pools one thread
// per 8 elements where a 16-bit row is quantized on the way in or
// dequantized on the way out, through kernels/fp8.h's conversions, the same
// functions the CPU backend calls.
//
// The FP8 paths store the CPU backend's bytes bit for bit and dequantize as
// it does (tests/gpu/fp8_gpu_test.cc, Fp8CudaBackend).
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/fp8.h"
#include "kernels/kv/kv_rows_cuda.h"

namespace attnserve {
namespace {

// CHUNK: bytes per thread: 16 (uint4 accesses) or 1.
template <int CHUNK, bool SCATTER>
__global__ void __launch_bounds__(256)
    CopyRowsKernel(uint8_t* cache_k, uint8_t* cache_v, uint8_t* rows_k, uint8_t* rows_v,
                   const int64_t* slots, int64_t n, int64_t row_bytes, int64_t layer_slot0) {
  using V = typename std::conditional<CHUNK == 16, uint4, uint8_t>::type;
  const int64_t chunks = row_bytes / CHUNK;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t i = idx / chunks;
  if (i >= n) return;
  const int64_t c = idx - i * chunks;
  const int64_t cache_off = (layer_slot0 + slots[i]) * row_bytes + c * CHUNK;
  const int64_t row_off = i * row_bytes + c * CHUNK;
  // cache_v null: an MLA pool, whose rows hold their values (K's only).
  if (SCATTER) {
    *reinterpret_cast<V*>(cache_k + cache_off) = *reinterpret_cast<const V*>(rows_k + row_off);
    if (cache_v != nullptr) {
      *reinterpret_cast<V*>(cache_v + cache_off) = *reinterpret_cast<const V*>(rows_v + row_off);
    }
  } else {
    *reinterpret_cast<V*>(rows_k + row_off) = *reinterpret_cast<const V*>(cache_k + cache_off);
    if (cache_v != nullptr) {
      *reinterpret_cast<V*>(rows_v + row_off) = *reinterpret_cast<const V*>(cache_v + cache_off);
    }
  }
}

// The scale of element e of a row of (layer-global) slot `slot`.
__device__ __forceinline__ float ScaleOf(const float* scales, int64_t slot, int64_t e,
                                         int64_t slots_per_layer, int32_t num_kv_heads,
                                         int32_t head_dim) {
  if (scales == nullptr) return 1.f;
  const int64_t layer = slot / slots_per_layer;
  return scales[layer * num_kv_heads + e / head_dim];
}

// float to 16-bit bits, round to nearest even (as common/dtype.h's host
// conversions).
template <bool BF16>
__device__ __forceinline__ uint16_t ToHalfBits(float x) {
  if (BF16) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
  return __half_as_ushort(__float2half_rn(x));
}

// 16-bit rows (n, row_elems) quantized into an FP8 pool: 8 elements a
// thread (row_elems % 8 == 0: head_dim is 64, 128 or 256).
template <bool BF16>
__global__ void __launch_bounds__(256)
    QuantizeRowsKernel(uint8_t* cache_k, uint8_t* cache_v, const uint16_t* rows_k,
                       const uint16_t* rows_v, const int64_t* slots, int64_t n, int64_t row_elems,
                       int64_t layer_slot0, int64_t slots_per_layer, int32_t num_kv_heads,
                       int32_t head_dim, Fp8Format format, const float* k_scales,
                       const float* v_scales) {
  const int64_t groups = row_elems / 8;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t i = idx / groups;
  if (i >= n) return;
  const int64_t e = (idx - i * groups) * 8;
  const int64_t slot = layer_slot0 + slots[i];
  const KvDType dtype = BF16 ? KvDType::kBf16 : KvDType::kFp16;
  for (int kv = 0; kv < 2; ++kv) {
    const uint16_t* src = (kv == 0 ? rows_k : rows_v) + i * row_elems + e;
    const float scale = ScaleOf(kv == 0 ? k_scales : v_scales, slot, e, slots_per_layer,
                                num_kv_heads, head_dim);
    const uint4 in = *reinterpret_cast<const uint4*>(src);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(&in);
    uint2 out;
    uint8_t* b = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
    for (int j = 0; j < 8; ++j) b[j] = Fp8Quantize(format, HalfBitsToFloat(dtype, h[j]), scale);
    *reinterpret_cast<uint2*>((kv == 0 ? cache_k : cache_v) + slot * row_elems + e) = out;
  }
}

// An FP8 pool's rows gathered as 16-bit values (stored value x scale).
template <bool BF16>
__global__ void __launch_bounds__(256)
    DequantizeRowsKernel(const uint8_t* cache_k, const uint8_t* cache_v, uint16_t* rows_k,
                         uint16_t* rows_v, const int64_t* slots, int64_t n, int64_t row_elems,
                         int64_t layer_slot0, int64_t slots_per_layer, int32_t num_kv_heads,
                         int32_t head_dim, Fp8Format format, const float* k_scales,
                         const float* v_scales) {
  const int64_t groups = row_elems / 8;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t i = idx / groups;
  if (i >= n) return;
  const int64_t e = (idx - i * groups) * 8;
  const int64_t slot = layer_slot0 + slots[i];
  for (int kv = 0; kv < 2; ++kv) {
    const float scale = ScaleOf(kv == 0 ? k_scales : v_scales, slot, e, slots_per_layer,
                                num_kv_heads, head_dim);
    const uint2 in = *reinterpret_cast<const uint2*>((kv == 0 ? cache_k : cache_v) +
                                                     slot * row_elems + e);
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&in);
    uint4 out;
    uint16_t* h = reinterpret_cast<uint16_t*>(&out);
#pragma unroll
    for (int j = 0; j < 8; ++j) h[j] = ToHalfBits<BF16>(Fp8ToFloat(format, b[j]) * scale);
    *reinterpret_cast<uint4*>((kv == 0 ? rows_k : rows_v) + i * row_elems + e) = out;
  }
}

unsigned Blocks(int64_t threads) { return static_cast<unsigned>((threads + 255) / 256); }

// Byte copies of whole stored rows (16-bit pools; FP8 rows as stored).
template <bool SCATTER>
cudaError_t Copy(void* cache_k, void* cache_v, void* k, void* v, const int64_t* slots, int64_t n,
                 int32_t layer, const KvGeometry& geo, cudaStream_t stream) {
  const int64_t row_bytes = geo.KvRowBytes();
  if (n == 0 || row_bytes == 0) return cudaSuccess;
  const int64_t layer_slot0 = int64_t{layer} * geo.SlotsPerLayer();
  auto* ck = static_cast<uint8_t*>(cache_k);
  auto* cv = geo.HasVPool() ? static_cast<uint8_t*>(cache_v) : nullptr;
  auto* rk = static_cast<uint8_t*>(k);
  auto* rv = static_cast<uint8_t*>(v);
  if (row_bytes % 16 == 0) {
    CopyRowsKernel<16, SCATTER><<<Blocks(n * (row_bytes / 16)), 256, 0, stream>>>(
        ck, cv, rk, rv, slots, n, row_bytes, layer_slot0);
  } else {
    CopyRowsKernel<1, SCATTER><<<Blocks(n * row_bytes), 256, 0, stream>>>(
        ck, cv, rk, rv, slots, n, row_bytes, layer_slot0);
  }
  return cudaGetLastError();
}

// One block per (listed page, layer): a page of one layer is contiguous,
// page_bytes of K and the same of V (a multiple of 16: head_dim % 16 == 0).
__global__ void __launch_bounds__(256)
    ZeroPagesKernel(uint4* cache_k, uint4* cache_v, const int32_t* pages, int64_t num_listed,
                    int64_t page_chunks, int64_t layer_chunks) {
  const int64_t layer = blockIdx.y;
  for (int64_t i = blockIdx.x; i < num_listed; i += gridDim.x) {
    const int64_t base = layer * layer_chunks + int64_t{pages[i]} * page_chunks;
    for (int64_t c = threadIdx.x; c < page_chunks; c += blockDim.x) {
      cache_k[base + c] = make_uint4(0, 0, 0, 0);
      if (cache_v != nullptr) cache_v[base + c] = make_uint4(0, 0, 0, 0);  // null: MLA
    }
  }
}

}  // namespace

cudaError_t ZeroPagesCuda(const ZeroPagesParams& p, cudaStream_t stream) {
  const KvGeometry& g = p.geo;
  if (p.num_pages_listed == 0 || g.num_layers == 0) return cudaSuccess;
  const int64_t page_bytes = int64_t{g.page_size} * g.KvRowBytes();
  if (page_bytes % 16 != 0 || g.num_layers > 65535) return cudaErrorInvalidValue;
  const int64_t page_chunks = page_bytes / 16;
  const int64_t layer_chunks = int64_t{g.num_pages} * page_chunks;
  const unsigned blocks_x = static_cast<unsigned>(std::min<int64_t>(p.num_pages_listed, 1 << 16));
  ZeroPagesKernel<<<dim3(blocks_x, static_cast<unsigned>(g.num_layers)), 256, 0, stream>>>(
      static_cast<uint4*>(p.k_cache), g.HasVPool() ? static_cast<uint4*>(p.v_cache) : nullptr,
      p.pages, p.num_pages_listed,
      page_chunks, layer_chunks);
  return cudaGetLastError();
}

cudaError_t AppendKvCuda(const AppendKvParams& p, cudaStream_t stream) {
  const KvGeometry& g = p.geo;
  if (!g.KvIsFp8() || p.rows_fp8) {
    return Copy<true>(p.k_cache, p.v_cache, const_cast<void*>(p.k), const_cast<void*>(p.v),
                      p.slots, p.n, p.layer, g, stream);
  }
  const int64_t row_elems = g.RowElems();
  if (p.n == 0 || row_elems == 0) return cudaSuccess;
  if (row_elems % 8 != 0 || !g.HasVPool()) return cudaErrorInvalidValue;  // no FP8 MLA pool here
  const int64_t layer_slot0 = int64_t{p.layer} * g.SlotsPerLayer();
  auto* ck = static_cast<uint8_t*>(p.k_cache);
  auto* cv = static_cast<uint8_t*>(p.v_cache);
  const auto* rk = static_cast<const uint16_t*>(p.k);
  const auto* rv = static_cast<const uint16_t*>(p.v);
  const unsigned blocks = Blocks(p.n * (row_elems / 8));
  if (g.dtype == KvDType::kBf16) {
    QuantizeRowsKernel<true><<<blocks, 256, 0, stream>>>(
        ck, cv, rk, rv, p.slots, p.n, row_elems, layer_slot0, g.SlotsPerLayer(), g.num_kv_heads,
        g.head_dim, g.kv_fp8, p.k_scales, p.v_scales);
  } else {
    QuantizeRowsKernel<false><<<blocks, 256, 0, stream>>>(
        ck, cv, rk, rv, p.slots, p.n, row_elems, layer_slot0, g.SlotsPerLayer(), g.num_kv_heads,
        g.head_dim, g.kv_fp8, p.k_scales, p.v_scales);
  }
  return cudaGetLastError();
}

cudaError_t GatherKvCuda(const GatherKvParams& p, cudaStream_t stream) {
  const KvGeometry& g = p.geo;
  if (!g.KvIsFp8() || !p.dequantize) {
    return Copy<false>(const_cast<void*>(p.k_cache), const_cast<void*>(p.v_cache), p.k, p.v,
                       p.slots, p.n, p.layer, g, stream);
  }
  const int64_t row_elems = g.RowElems();
  if (p.n == 0 || row_elems == 0) return cudaSuccess;
  if (row_elems % 8 != 0 || !g.HasVPool()) return cudaErrorInvalidValue;  // no FP8 MLA pool here
  const int64_t layer_slot0 = int64_t{p.layer} * g.SlotsPerLayer();
  const auto* ck = static_cast<const uint8_t*>(p.k_cache);
  const auto* cv = static_cast<const uint8_t*>(p.v_cache);
  auto* rk = static_cast<uint16_t*>(p.k);
  auto* rv = static_cast<uint16_t*>(p.v);
  const unsigned blocks = Blocks(p.n * (row_elems / 8));
  if (g.dtype == KvDType::kBf16) {
    DequantizeRowsKernel<true><<<blocks, 256, 0, stream>>>(
        ck, cv, rk, rv, p.slots, p.n, row_elems, layer_slot0, g.SlotsPerLayer(), g.num_kv_heads,
        g.head_dim, g.kv_fp8, p.k_scales, p.v_scales);
  } else {
    DequantizeRowsKernel<false><<<blocks, 256, 0, stream>>>(
        ck, cv, rk, rv, p.slots, p.n, row_elems, layer_slot0, g.SlotsPerLayer(), g.num_kv_heads,
        g.head_dim, g.kv_fp8, p.k_scales, p.v_scales);
  }
  return cudaGetLastError();
}

}  // namespace attnserve
