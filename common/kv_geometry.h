// The KV cache's element type and geometry, shared by the kernels (CPU and
// CUDA), the server and the client library. Plain C++: no CUDA, no gRPC.
//
// Every kernel family (paged_prefill, merge_states, append_kv) has a params
// struct of plain pointers and sizes declared in its own header under
// kernels/; the CPU reference and the CUDA launcher take the same struct and
// the KvGeometry below.
#pragma once

#include <cstdint>

namespace attnserve {

// The 16-bit element type of queries and outputs, and of the K and V rows
// a write takes (WriteKV, fused appends); also of the K and V pools unless
// they are FP8 (KvGeometry::kv_fp8). LSE is always float32.
enum class KvDType : int32_t { kBf16 = 0, kFp16 = 1 };

inline constexpr int64_t KvDTypeBytes(KvDType) { return 2; }

// The FP8 format of the K and V pools (kernels/fp8.h: the formats, scales
// and conversions); kNone: the pools hold the 16-bit dtype.
enum class Fp8Format : int32_t { kNone = 0, kE4m3 = 1, kE5m2 = 2 };

// Its name in flags and messages: "fp8_e4m3", "fp8_e5m2" ("none").
inline constexpr const char* Fp8FormatName(Fp8Format f) {
  return f == Fp8Format::kE4m3 ? "fp8_e4m3" : f == Fp8Format::kE5m2 ? "fp8_e5m2" : "none";
}

// The head_dims attnserve serves (every backend; the CUDA kernels are
// specialised for exactly these).
inline constexpr bool IsSupportedHeadDim(int32_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}
// How messages name them.
inline constexpr const char kSupportedHeadDims[] = "64, 128 or 256";

// Geometry of the paged KV cache. For each layer, K and V are each shaped
// [num_pages, page_size, num_kv_heads, head_dim]; the pools hold all layers
// back to back: [num_layers, num_pages, page_size, num_kv_heads, head_dim],
// KvElemBytes() bytes an element (1 for FP8, 2 otherwise).
struct KvGeometry {
  int32_t num_layers = 0;
  int32_t num_pages = 0;
  int32_t page_size = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  // Queries and outputs (and the pools when kv_fp8 is kNone).
  KvDType dtype = KvDType::kBf16;
  // The pools' FP8 format; kNone: they hold `dtype`. Every combination is
  // valid (an FP8 pool with bf16 or fp16 queries).
  Fp8Format kv_fp8 = Fp8Format::kNone;

  // Elements in one token row of K (or V): num_kv_heads * head_dim.
  int64_t RowElems() const { return int64_t{num_kv_heads} * head_dim; }
  // Total slots in one layer: num_pages * page_size.
  int64_t SlotsPerLayer() const { return int64_t{num_pages} * page_size; }
  // Elements of one layer of K (or V).
  int64_t LayerElems() const { return SlotsPerLayer() * RowElems(); }
  // Elements of the whole K (or V) pool.
  int64_t PoolElems() const { return LayerElems() * num_layers; }

  bool KvIsFp8() const { return kv_fp8 != Fp8Format::kNone; }
  // Bytes of one element of the K and V pools, and of queries and outputs.
  int64_t KvElemBytes() const { return KvIsFp8() ? 1 : KvDTypeBytes(dtype); }
  int64_t QElemBytes() const { return KvDTypeBytes(dtype); }
  // Bytes of one stored row of K (or V), of one layer, of the whole K (or V)
  // pool.
  int64_t KvRowBytes() const { return RowElems() * KvElemBytes(); }
  int64_t LayerBytes() const { return LayerElems() * KvElemBytes(); }
  int64_t PoolBytes() const { return PoolElems() * KvElemBytes(); }
};

}  // namespace attnserve
