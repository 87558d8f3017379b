// The float64 reference of attnserve's numerics (docs/design.md section 3):
// paged prefill attention, its variants (sliding window, logit soft-cap,
// sinks; docs/design.md, "Variants") and the N-way merge of (output, LSE)
// states. Written from the definitions, sharing no code with the kernels
// (kernels/variant.h is their one statement of the same rules), so that the
// tests that compare a kernel (CPU or CUDA) or the whole server with it can
// fail. Used by the kernel, integration and GPU tests and by
// `attnbench --verify` (through client/workload.h). Plain C++: no CUDA, no
// gRPC.
#pragma once

#include <cstdint>
#include <vector>

#include "common/kv_geometry.h"

namespace attnserve {
namespace reference {

// Where the reference reads K and V: the row of (layer, slot) as the pools
// store it, num_kv_heads * head_dim elements of the geometry's
// KvElemBytes(): 16-bit values of geo.dtype, or FP8 bytes of geo.kv_fp8,
// whose real values are the FP8 values times KScale / VScale of their layer
// and KV head (the reference decodes FP8 from the formats' definitions, on
// its own). Must be safe to call from several threads at once when Prefill
// is given more than one thread.
class KvRows {
 public:
  virtual ~KvRows() = default;
  virtual const void* K(int32_t layer, int64_t slot) const = 0;
  virtual const void* V(int32_t layer, int64_t slot) const = 0;
  // FP8 rows' scales (real = fp8 value x scale); unused for 16-bit rows.
  virtual double KScale(int32_t /*layer*/, int32_t /*kv_head*/) const { return 1.0; }
  virtual double VScale(int32_t /*layer*/, int32_t /*kv_head*/) const { return 1.0; }
};

// Host pools laid out as the server's: [num_layers, num_pages, page_size,
// num_kv_heads, head_dim] each, and for FP8 pools their (num_layers,
// num_kv_heads) scales (null: 1.0). MLA has no V pool (v_pool is ignored):
// a row's values are the first VDim() values of its latent (K) row. The
// pointers must outlive this.
class HostPools final : public KvRows {
 public:
  HostPools(const KvGeometry& geo, const void* k_pool, const void* v_pool,
            const float* k_scales = nullptr, const float* v_scales = nullptr)
      : geo_(geo),
        k_(static_cast<const char*>(k_pool)),
        v_(geo.HasVPool() ? static_cast<const char*>(v_pool) : k_),
        k_scales_(k_scales),
        v_scales_(v_scales) {}
  const void* K(int32_t layer, int64_t slot) const override { return k_ + Offset(layer, slot); }
  const void* V(int32_t layer, int64_t slot) const override { return v_ + Offset(layer, slot); }
  double KScale(int32_t layer, int32_t kv_head) const override {
    return Scale(k_scales_, layer, kv_head);
  }
  double VScale(int32_t layer, int32_t kv_head) const override {
    return Scale(v_scales_, layer, kv_head);
  }

 private:
  int64_t Offset(int32_t layer, int64_t slot) const {
    return (int64_t{layer} * geo_.SlotsPerLayer() + slot) * geo_.KvRowBytes();
  }
  double Scale(const float* scales, int32_t layer, int32_t kv_head) const {
    return scales == nullptr ? 1.0 : scales[int64_t{layer} * geo_.num_kv_heads + kv_head];
  }
  KvGeometry geo_;
  const char* k_;
  const char* v_;
  const float* k_scales_;
  const float* v_scales_;
};

// The real value of FP8 bits of `format` (kE4m3 or kE5m2), from the format's
// definition: NaN for its NaN patterns, +-inf for E5M2's infinities.
double Fp8Value(Fp8Format format, uint8_t bits);

// The conformance suite's LSE bounds against the float64 reference
// (absolute, in the LSE's own units; docs/design.md section 3): every
// kernel's rows, and the rows of sequences a server computes on queries
// rounded to E4M3 (ServerInfo.fp8_query_min_rows: --prefill_kernel=
// sm90_fp8q, whose FP8 tensor cores sum a step's 32 products with about 13
// bits, so that a logit's error grows with the sum of its products'
// magnitudes): kFp8QueryLseBound, or kFp8QueryLseSlope times the row's
// largest |sm_scale| sum_d |q_d k_jd| over the keys it sees (in the LSE's
// units), whichever is larger (Prefill's lse_bound). Seen up to 2^-11.8 of
// that sum through a server, bench/results/2026-12-07-session42-h100.md.
inline constexpr double kLseBound = 1e-3;
inline constexpr double kFp8QueryLseBound = 4e-3;
inline constexpr double kFp8QueryLseSlope = 1.0 / 1024;

// The FP8-query prefill kernel's rounding of one query row (one token, one
// head; --prefill_kernel=sm90_fp8q, ServerInfo.fp8_query_min_rows), from
// E4M3's definition: with a the row's largest finite |q| and e = 7 -
// floor(log2 a) clamped to [-100, 100] (0 when a is 0), each element x
// becomes E4M3(x 2^e) 2^-e, where E4M3 rounds to the nearest of its values
// (ties to the even significand) and saturates at +-448 (an infinity too; a
// NaN stays one, a zero keeps its sign). Rewrites the n float64 elements of
// `row` in place, exactly (the kernel multiplies the E4M3 values by 2^-e in
// fp32; Seq::fp8_queries rounds a sequence's rows so).
void RoundQueryRowToE4m3(double* row, int32_t n);
// The same on a row of dtype's 16-bit values, its results stored back in
// dtype: exact for bf16, and for fp16 rows whose largest |q| lies in
// [2^-8, 65280) (below, the smallest steps fall under fp16's subnormals;
// above, 65280 and beyond round to 65536, past fp16's range).
void RoundQueryRowToE4m3(KvDType dtype, uint16_t* row, int32_t n);

// One sequence of a ragged batch.
struct Seq {
  int64_t q_start = 0;   // first query row in q
  int64_t q_len = 0;     // query rows
  int64_t kv_start = 0;  // first page id of the sequence in kv_indices
  int64_t kv_len = 0;    // tokens; position j is slot kv_indices[kv_start + j / page_size] *
                         // page_size + j % page_size
  int32_t layer = 0;
  double sm_scale = 0;   // logits are dot(q, k) * sm_scale
  bool causal = true;
  // Row i is at position p = i + kv_len - q_len + causal_shift (0:
  // bottom-right alignment). Causal: it sees positions j <= p.
  int64_t causal_shift = 0;
  // Sliding window: row i sees no position j < p - window_left (with the
  // causal mask p - window_left .. p; without it a left bound only). -1: none.
  int64_t window_left = -1;
  // > 0: a logit x = dot(q, k) * sm_scale becomes soft_cap * tanh(x / soft_cap).
  double soft_cap = 0;
  // (num_qo_heads) sink logits in natural units, or null: sinks[h] enters the
  // softmax denominator of every row of head h (e^sinks[h] beside the keys'
  // e^x) and so the LSE; -inf is no sink. A row that sees no key gets o = 0
  // and LSE = sinks[h].
  const float* sinks = nullptr;
  bool lse_base_e = false;  // LSE in natural log; base 2 otherwise
  // The sequence's query rows rounded as the FP8-query kernel rounds them
  // (RoundQueryRowToE4m3, in float64) before the math.
  bool fp8_queries = false;
};

// (sm_scale, soft_cap) pairs at the ends of their ranges (the server's
// bounds: |sm_scale| <= 1e30, a soft-cap of 0 or in [1e-30, 1e30]): over a
// zero dot product scale / soft_cap overflows float32 for the tiny caps and
// the huge scales. The conformance tests of every kernel family run them.
struct ScaleAndCap {
  float sm_scale;
  float soft_cap;
};
inline constexpr ScaleAndCap kExtremeScalesAndCaps[] = {
    {0.125f, 1e-30f}, {-0.125f, 1e-30f}, {1e30f, 1e-9f}, {-1e30f, 1e-9f}, {0.125f, 1e30f}, {1e-30f, 1e30f}};

// Paged prefill attention in float64, over K and V as their real values
// (an FP8 pool's dequantized: its stored values times their scales). q:
// (total_q, num_qo_heads, head_dim) in geo.dtype. Query head h reads KV head
// h / (num_qo_heads / num_kv_heads); values are the first geo.VDim()
// elements of kv.V()'s rows (MLA: of the latent rows, all of them for GQA).
// Fills o (total_q, num_qo_heads, VDim()) and lse (total_q, num_qo_heads),
// each in its sequence's base; a row that sees nothing (and a row of no
// sequence) gets o = 0 and lse = -inf, or the sink's logit when it has one. `threads` > 1 splits the (sequence,
// head) pairs over that many threads. lse_bound (optional, (total_q,
// num_qo_heads)): each LSE's bound for a kernel's result, kLseBound, and on
// the rows of Seq::fp8_queries sequences the FP8-query kernel's (above).
void Prefill(const KvGeometry& geo, const KvRows& kv, const uint16_t* q, int64_t total_q,
             const std::vector<int32_t>& kv_indices, const std::vector<Seq>& seqs,
             std::vector<double>* o, std::vector<double>* lse, int threads = 1,
             std::vector<double>* lse_bound = nullptr);

// One partial state: v (rows, d) in the dtype given to Merge, lse (rows).
struct State {
  const uint16_t* v = nullptr;
  const float* lse = nullptr;
};

// N-way merge in float64: for each row, m = max lse_i, w_i = base^(lse_i - m),
// v = sum w_i v_i / sum w_i, lse = m + log_base(sum w_i). A -inf state adds
// nothing; a row whose states are all -inf gets (0, -inf). Fills v (rows, d)
// and lse (rows).
void Merge(KvDType dtype, const std::vector<State>& states, int64_t rows, int32_t d,
           bool lse_base_e, std::vector<double>* v, std::vector<double>* lse);

}  // namespace reference
}  // namespace attnserve
