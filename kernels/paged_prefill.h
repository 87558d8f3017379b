// Paged prefill attention: params shared by the CPU reference
// (PagedPrefillCpu, here) and the CUDA kernel (paged_prefill_cuda.h).
//
// Conventions (docs/design.md section 3; the rules themselves are written
// once, in kernels/variant.h):
//  - GQA: query head h reads KV head h / (num_qo_heads / num_kv_heads).
//  - Row t sees the keys RowKeys(seq, t): causal (aligned bottom-right,
//    shifted by causal_shift) and a sliding window (window_left) bound them.
//  - Logits are dot(q, k) * sm_scale, soft-capped when soft_cap > 0.
//  - A sink (one logit per query head) enters the denominator only.
//  - LSE is the log-sum-exp of the logits over the visible keys (and the
//    sink), base 2 unless the sequence asks for base e.
//  - A row that sees nothing gets output 0 and LSE -inf (the sink with one);
//    never NaN.
//  - fp32 accumulation.
//  - MLA (geo.IsMla(), docs/design.md "Multi-head latent attention"): one
//    KV head of head_dim-wide latent rows; the values are each row's first
//    geo.VDim() elements (v_cache is k_cache), outputs are VDim() wide.
//  - An FP8 pool (geo.kv_fp8, kernels/fp8.h) holds K and V as FP8 bytes:
//    the real value of an element of layer l and KV head h is its FP8 value
//    times k_scales[l * num_kv_heads + h] (v_scales for V). Queries and
//    outputs stay geo.dtype (16-bit).
#pragma once

#include <cstdint>
#include <functional>

#include "common/kv_geometry.h"

namespace attnserve {

// One sequence of a ragged batch. A batch may mix layers, scales and masks:
// every per-request setting lives here.
struct PrefillSeq {
  int32_t q_start = 0;     // first row of this sequence in q / o / lse
  int32_t q_len = 0;       // query rows
  int32_t kv_start = 0;    // first entry of kv_indices for this sequence
  int32_t kv_len = 0;      // KV tokens: (pages - 1) * page_size + last_page_len
  int32_t layer = 0;       // layer of the KV pools to read
  float sm_scale = 0.f;    // logit scale, natural units (1/sqrt(head_dim) default)
  // Causal only: row i sees KV positions j <= i + kv_len - q_len +
  // causal_shift. 0 is bottom-right alignment; a server that holds only part
  // of a sequence's keys gets the number of the sequence's keys held after
  // its range (docs/design.md section 3).
  int32_t causal_shift = 0;
  // Sliding window (kernels/variant.h): row t sees no key before
  // QueryPos(t) - window_left; -1: no window.
  int32_t window_left = -1;
  float soft_cap = 0.f;    // > 0: logits become soft_cap * tanh(logit / soft_cap)
  // Sinks: PagedPrefillParams::sinks[sink_index * num_qo_heads + head] (one
  // logit per query head, natural units); -1: none.
  int32_t sink_index = -1;
  uint8_t causal = 1;      // 1: causal mask
  uint8_t lse_base_e = 0;  // 1: LSE in natural log; 0: base 2
  uint8_t pad_[2] = {0, 0};
};

struct PagedPrefillParams {
  const void* q = nullptr;      // (total_q, num_qo_heads, head_dim), dtype
  void* o = nullptr;            // (total_q, num_qo_heads, geo.VDim()), dtype
  float* lse = nullptr;         // (total_q, num_qo_heads), float32
  // (num_layers, num_pages, page_size, num_kv_heads, head_dim), elements of
  // geo.KvElemBytes(): geo.dtype, or FP8 bytes of geo.kv_fp8.
  const void* k_cache = nullptr;
  // Same shape as k_cache; MLA: k_cache itself (V is the first VDim()
  // values of each row).
  const void* v_cache = nullptr;
  // FP8 pools only: (num_layers, num_kv_heads) float32 dequantization
  // scales of K and V (real = fp8 value x scale), on the kernel's side of
  // the bus (device memory for the CUDA families). Per-layer scales are
  // repeated over the layer's heads. Ignored (and may be null) for 16-bit
  // pools; null on an FP8 pool means 1.0 everywhere.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  const int32_t* kv_indices = nullptr;  // page ids; sequence s uses
                                        // kv_indices[seqs[s].kv_start ...]
  const PrefillSeq* seqs = nullptr;     // (num_seqs)
  // (sink sets, num_qo_heads) float32: the sinks of the sequences whose
  // sink_index names a set; null when none has one.
  const float* sinks = nullptr;
  // Some sequence has a soft_cap: kernels with instantiations without the
  // soft-cap's code (kernels/sm90) run one only when this is false (and one
  // without the sinks' code only when sinks is null). Whoever fills seqs
  // sets it (AnySoftCap below).
  bool any_soft_cap = false;
  // The batch's mean KV length per query row (MeanKvPerRow below, over the
  // sequences the prefill family runs; 0: not given). On 16-bit pools the
  // sm90 family loads pages by the tensor copy engine only at
  // kSm90TensorCopyMinMeanKv keys and up (kernels/plan/kernel_select.h,
  // Sm90TensorCopies), by cp.async below it; 0 takes the tensor copies
  // wherever the pages allow.
  int64_t mean_kv_per_row = 0;
  int32_t num_seqs = 0;
  int32_t total_q = 0;          // rows of q / o / lse
  KvGeometry geo;
  // Persistent kernels (PrefillPersistentCtas in kernels/plan/kernel_select.h)
  // launch min(work items, max_ctas) CTAs that loop over the items; 0: one
  // wave (the device's SMs times the kernel's occupancy). The plan's
  // persistent_ctas should match. Tests set a few to run many items per CTA.
  int32_t max_ctas = 0;
};

// The mean KV length per query row of seqs[0, n): sum(q_len * kv_len) /
// sum(q_len), 0 when they have no rows (mean_kv_per_row; the measure
// ChoosePrefillKernel takes too).
inline int64_t MeanKvPerRow(const PrefillSeq* seqs, int32_t n) {
  int64_t rows = 0, row_keys = 0;
  for (int32_t i = 0; i < n; ++i) {
    rows += seqs[i].q_len;
    row_keys += int64_t{seqs[i].q_len} * seqs[i].kv_len;
  }
  return rows > 0 ? row_keys / rows : 0;
}

// Whether any of seqs[0, n) has a soft-cap (any_soft_cap).
inline bool AnySoftCap(const PrefillSeq* seqs, int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    if (seqs[i].soft_cap != 0.f) return true;
  }
  return false;
}

// CPU reference: computes o and lse for every row of every sequence.
// Multi-threaded (OpenMP). Inputs must already be validated (page ids in
// range, kv_len consistent with the indices).
void PagedPrefillCpu(const PagedPrefillParams& params);

// The same, asking `stop` (may be null; called from several threads at
// once) before each part of the work: once it says true, the rest is not
// computed and some rows of o and lse are left unwritten; returns false
// then. How the work is cut does not depend on `stop`, so a run it never
// stops gives the bits of PagedPrefillCpu.
bool PagedPrefillCpu(const PagedPrefillParams& params, const std::function<bool()>* stop);

}  // namespace attnserve
