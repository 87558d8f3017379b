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

// Element type of queries, keys, values and outputs. LSE is always float32.
enum class KvDType : int32_t { kBf16 = 0, kFp16 = 1 };

inline constexpr int64_t KvDTypeBytes(KvDType) { return 2; }

// The head_dims attnserve serves (every backend; the CUDA kernels are
// specialised for exactly these).
inline constexpr bool IsSupportedHeadDim(int32_t head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}
// How messages name them.
inline constexpr const char kSupportedHeadDims[] = "64, 128 or 256";

// Geometry of the paged KV cache. For each layer, K and V are each shaped
// [num_pages, page_size, num_kv_heads, head_dim]; the pools hold all layers
// back to back: [num_layers, num_pages, page_size, num_kv_heads, head_dim].
struct KvGeometry {
  int32_t num_layers = 0;
  int32_t num_pages = 0;
  int32_t page_size = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  KvDType dtype = KvDType::kBf16;

  // Elements in one token row of K (or V): num_kv_heads * head_dim.
  int64_t RowElems() const { return int64_t{num_kv_heads} * head_dim; }
  // Total slots in one layer: num_pages * page_size.
  int64_t SlotsPerLayer() const { return int64_t{num_pages} * page_size; }
  // Elements of one layer of K (or V).
  int64_t LayerElems() const { return SlotsPerLayer() * RowElems(); }
  // Elements of the whole K (or V) pool.
  int64_t PoolElems() const { return LayerElems() * num_layers; }
};

}  // namespace attnserve
