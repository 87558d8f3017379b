// The KV cache's element type and geometry, shared by the kernels (CPU and
// CUDA), the server and the client library. Plain C++: no CUDA, no gRPC.
//
// Every kernel family (paged_prefill, merge_states, append_kv) has a params
// struct of plain pointers and sizes declared in its own header under
// kernels/; the CPU reference and the CUDA launcher take the same struct and
// the KvGeometry below.
#pragma once

#include <cstdint>
#include <string>

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

// What attention the server computes (docs/design.md, "Multi-head latent
// attention"). kGqa: K and V pools of num_kv_heads x head_dim rows. kMla:
// one pool of latent rows (num_kv_heads 1, head_dim = kv_lora_rank +
// qk_rope_head_dim) shared by every query head; a row's first kv_lora_rank
// values are its V. Queries are head_dim wide, outputs VDim() wide.
enum class AttentionKind : int32_t { kGqa = 0, kMla = 1 };

inline constexpr const char* AttentionKindName(AttentionKind a) {
  return a == AttentionKind::kMla ? "mla" : "gqa";
}

// MLA's latent sizes: kv_lora_rank a multiple of 16 in [16, 1024],
// qk_rope_head_dim a multiple of 16 in [0, 256].
inline constexpr bool IsSupportedKvLoraRank(int32_t r) {
  return r >= 16 && r <= 1024 && r % 16 == 0;
}
inline constexpr bool IsSupportedRopeDim(int32_t r) { return r >= 0 && r <= 256 && r % 16 == 0; }

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
// KvElemBytes() bytes an element (1 for FP8, 2 otherwise). MLA has the K
// pool alone (HasVPool() false): V is the first VDim() values of K's rows.
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
  AttentionKind attention = AttentionKind::kGqa;
  // MLA only (0 for GQA): head_dim = kv_lora_rank + qk_rope_head_dim.
  int32_t kv_lora_rank = 0;
  int32_t qk_rope_head_dim = 0;

  bool IsMla() const { return attention == AttentionKind::kMla; }
  // Width of a value row, an output row and a merged state: head_dim, or
  // kv_lora_rank for MLA.
  int32_t VDim() const { return IsMla() ? kv_lora_rank : head_dim; }
  // Whether V has a pool (and writes a V tensor) of its own.
  bool HasVPool() const { return !IsMla(); }
  // Pools a page spans in every layer: K and V, or the latent pool alone.
  int32_t NumPools() const { return HasVPool() ? 2 : 1; }
  // Elements of one query row (num_qo_heads * head_dim) and of one output
  // row (num_qo_heads * VDim()).
  int64_t QRowElems() const { return int64_t{num_qo_heads} * head_dim; }
  int64_t ORowElems() const { return int64_t{num_qo_heads} * VDim(); }

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

// What is wrong with a geometry's shape (every field but num_pages), named
// as `prefix` + field ("--" for the server's flags, "ServerInfo." for what a
// client was told), or "" when nothing is: num_layers in [1, 1024],
// page_size in [1, 128], num_kv_heads in [1, 256], num_qo_heads in [1, 256]
// and a multiple of it, a supported head_dim, or for MLA supported latent
// sizes with num_kv_heads 1 and head_dim their sum.
inline std::string GeometryShapeError(const KvGeometry& g, const std::string& prefix) {
  auto range = [&](const char* field, int32_t v, int32_t lo, int32_t hi) {
    return prefix + field + "=" + std::to_string(v) + " out of range [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "]";
  };
  if (g.num_layers < 1 || g.num_layers > 1024) return range("num_layers", g.num_layers, 1, 1024);
  if (g.page_size < 1 || g.page_size > 128) return range("page_size", g.page_size, 1, 128);
  if (g.IsMla()) {
    if (!IsSupportedKvLoraRank(g.kv_lora_rank)) {
      return prefix + "kv_lora_rank=" + std::to_string(g.kv_lora_rank) + " must be a multiple of 16 in [16, 1024]";
    }
    if (!IsSupportedRopeDim(g.qk_rope_head_dim)) {
      return prefix + "qk_rope_head_dim=" + std::to_string(g.qk_rope_head_dim) +
             " must be a multiple of 16 in [0, 256]";
    }
    if (g.num_kv_heads != 1 || g.head_dim != g.kv_lora_rank + g.qk_rope_head_dim) {
      return prefix + "num_kv_heads=" + std::to_string(g.num_kv_heads) + " and " + prefix +
             "head_dim=" + std::to_string(g.head_dim) + " must be 1 and kv_lora_rank + qk_rope_head_dim (" +
             std::to_string(g.kv_lora_rank + g.qk_rope_head_dim) + ") with MLA";
    }
  } else if (!IsSupportedHeadDim(g.head_dim)) {
    return prefix + "head_dim=" + std::to_string(g.head_dim) + " must be " + kSupportedHeadDims;
  }
  if (g.num_kv_heads < 1 || g.num_kv_heads > 256) return range("num_kv_heads", g.num_kv_heads, 1, 256);
  if (g.num_qo_heads < 1 || g.num_qo_heads > 256 || g.num_qo_heads % g.num_kv_heads != 0) {
    return prefix + "num_qo_heads=" + std::to_string(g.num_qo_heads) + " must be in [1, 256] and a multiple of " +
           prefix + "num_kv_heads=" + std::to_string(g.num_kv_heads);
  }
  return "";
}

}  // namespace attnserve
