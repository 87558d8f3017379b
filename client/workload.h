// Random ragged workloads and their float64 reference (common/reference.h),
// used by `attnctl prefill`, the integration tests and attnbench's
// verification.
//
// KvMirror keeps the client's own copy of every K/V row it wrote, so the
// reference needs nothing from the server.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "common/kv_geometry.h"

namespace attnserve {

// Random 16-bit values (bf16 or fp16) drawn from N(0, stddev^2).
std::vector<uint16_t> RandomHalves(std::mt19937_64& gen, KvDType dtype, int64_t n,
                                   double stddev = 1.0);

// The client's copy of the K/V rows it wrote, by (layer, slot), as the
// server stores them: on an FP8 server (geo.kv_fp8) the 16-bit rows given to
// Write are quantized as the server does (kernels/fp8.h, with the scales
// given to SetScales, 1.0 until then), and the reference reads them
// dequantized.
class KvMirror {
 public:
  explicit KvMirror(const KvGeometry& geo);
  // k_rows, v_rows: (slots.size(), num_kv_heads, head_dim) in geo.dtype; an
  // MLA geometry takes the latent rows in k_rows (v_rows unused), and V()
  // and StoredV() answer them too (the reference reads V's first VDim()
  // values).
  void Write(int32_t layer, absl::Span<const int64_t> slots, absl::Span<const uint16_t> k_rows,
             absl::Span<const uint16_t> v_rows);
  // FP8 rows as stored (an FP8 geometry only): (slots.size(), num_kv_heads,
  // head_dim) bytes each.
  void WriteStored(int32_t layer, absl::Span<const int64_t> slots,
                   absl::Span<const uint8_t> k_rows, absl::Span<const uint8_t> v_rows);
  // An FP8 geometry's scales of `layer`: num_kv_heads entries each (the
  // server's GetKvScales), for the rows written from then on and for the
  // reference's dequantization of every row of the layer.
  void SetScales(int32_t layer, absl::Span<const float> k_scales, absl::Span<const float> v_scales);
  // 16-bit geometries: the row of (num_kv_heads * head_dim) values; zeros
  // for a slot never written.
  const uint16_t* K(int32_t layer, int64_t slot) const;
  const uint16_t* V(int32_t layer, int64_t slot) const;
  // The row as stored (geo.KvRowBytes() bytes; FP8 bytes on an FP8 geometry).
  const void* StoredK(int32_t layer, int64_t slot) const;
  const void* StoredV(int32_t layer, int64_t slot) const;
  // (num_layers, num_kv_heads) scales.
  const std::vector<float>& k_scales() const { return k_scales_; }
  const std::vector<float>& v_scales() const { return v_scales_; }
  const KvGeometry& geometry() const { return geo_; }

 private:
  const void* Row(const absl::flat_hash_map<int64_t, std::vector<uint8_t>>& rows, int32_t layer,
                  int64_t slot) const;
  KvGeometry geo_;
  absl::flat_hash_map<int64_t, std::vector<uint8_t>> k_, v_;  // key: layer * slots + slot
  std::vector<float> k_scales_, v_scales_;
  std::vector<uint8_t> zeros_;
};

// Copies an FP8 server's KV scales (GetKvScales) into `mirror`, whose
// geometry must be the server's; nothing to do for a 16-bit server.
absl::Status MirrorServerScales(Client& client, KvMirror* mirror);

// One Prefill's inputs, in the API's layout.
struct PrefillInputs {
  int32_t layer = 0;
  std::vector<uint16_t> q;  // (total_q, num_qo_heads, head_dim)
  std::vector<int32_t> qo_indptr, kv_indptr, kv_indices, kv_last_page_len;
  std::optional<float> sm_scale;
  bool causal = true;
  bool lse_base_e = false;
  // (batch) or empty: keys of each sequence after this range (causal shift).
  std::vector<int32_t> kv_keys_after;
  // Sliding window, soft-cap, sinks (docs/design.md, "Variants"), and
  // (batch) or empty: 0 where the sinks do not enter sequence b.
  AttentionOptions options;
  std::vector<uint8_t> apply_sinks;
  int64_t total_q() const { return qo_indptr.empty() ? 0 : qo_indptr.back(); }
};

// float64 attention per docs/design.md section 3: o (total_q, Hq, D), lse
// (total_q, Hq) with -inf for rows that see nothing (the sink's logit with
// a sink). Row i of sequence b is at position p = i + kv_len - q_len +
// kv_keys_after[b]; causal, it sees j <= p; a window drops j < p - window_left.
// fp8_query_min_rows: the server's ServerInfo.fp8_query_min_rows; when
// non-zero, the query rows of every sequence of at least that many rows are
// rounded to E4M3 first, as that server computes them
// (reference::RoundQueryRowToE4m3). lse_bound (optional): each LSE entry's
// bound for Compare, the FP8-query kernel's for those rows (at least
// reference::kFp8QueryLseBound, more for large logits: reference::Prefill)
// and reference::kLseBound for the others.
void ReferencePrefill(const KvMirror& kv, const PrefillInputs& in, std::vector<double>* o,
                      std::vector<double>* lse, int32_t fp8_query_min_rows = 0,
                      std::vector<double>* lse_bound = nullptr);

// Attention options drawn at random over the cases of the variant
// conformance suite (docs/design.md, "Variants"), for tests (tests/kernels,
// tests/gpu, tests/integration) and attnbench:
//  - window_left: unset, -1, 0, 1, a page of keys (page_size - 1), a kernel
//    block of keys (63, 127) or one more (64, 128), larger than any sequence
//    of max_kv_len keys, or uniform in [0, max_kv_len];
//  - logits_soft_cap: unset, 0, or one of 1, 5, 30, 50;
//  - sinks: none, all -inf, all 0, all large (8), or per head N(0, 2^2) with
//    some -inf.
// Each drawn independently, about half the time not plain.
AttentionOptions RandomOptions(std::mt19937_64& gen, const KvGeometry& geo, int32_t max_kv_len);

// `n` sink logits (natural units) of one of the kinds above, as RandomOptions
// draws them (never empty).
std::vector<float> RandomSinks(std::mt19937_64& gen, int32_t n);

// The Prefill arguments viewing `in` (which must outlive them).
PrefillArgs ArgsOf(const PrefillInputs& in);

// Every slot of `pages`, page by page: page * page_size + offset.
std::vector<int64_t> SlotsOfPages(const KvGeometry& geo, absl::Span<const int32_t> pages);

// Shape of a random workload.
struct WorkloadSpec {
  int32_t batch = 4;
  int32_t max_q_len = 64;
  int32_t max_kv_len = 256;
  bool causal = true;
  bool lse_base_e = false;
  int32_t layer = 0;
  // Draw each request's attention options (RandomOptions).
  bool variants = false;
};

// Draws sequence lengths and q; assigns pages (shuffled) from `pages`
// (non-empty; when it holds fewer than the sequences need, the ids start
// over and repeat, which the API allows). Rows that see nothing (q_len > kv_len) and empty
// sequences arise naturally from the random lengths.
PrefillInputs RandomPrefill(std::mt19937_64& gen, const KvGeometry& geo, const WorkloadSpec& spec,
                            absl::Span<const int32_t> pages);

// Pages RandomPrefill may need at most.
int64_t PagesNeeded(const KvGeometry& geo, const WorkloadSpec& spec);

// Result against the reference (docs/design.md section 3 tolerances).
struct Comparison {
  double o_rel_error = 0;      // ||o - ref|| / ||ref|| (bound: 1e-2)
  double lse_max_abs = 0;      // over rows where the reference is finite
  int64_t lse_over_bound = 0;  // such rows off by more than their bound
  int64_t inf_mismatches = 0;  // -inf in one but not the other
  int64_t nan_count = 0;
  bool Ok(KvDType dtype) const;
  std::string ToString() const;
};

// lse_bound: each LSE entry's bound (ReferencePrefill's), or empty for
// reference::kLseBound everywhere.
Comparison Compare(KvDType dtype, absl::Span<const double> o_ref, absl::Span<const double> lse_ref,
                   absl::Span<const uint16_t> o, absl::Span<const float> lse,
                   absl::Span<const double> lse_bound = {});

}  // namespace attnserve
