// Paged prefill attention: params shared by the CPU reference
// (PagedPrefillCpu, here) and the CUDA kernel (paged_prefill_cuda.h).
//
// Conventions (docs/design.md section 3):
//  - GQA: query head h reads KV head h / (num_qo_heads / num_kv_heads).
//  - Causal mask aligned bottom-right: row i (0-based within its sequence)
//    sees KV positions j <= i + kv_len - q_len + causal_shift (causal_shift
//    is 0 unless the request places its KV range inside a longer sequence).
//  - LSE is the log-sum-exp of the scaled logits over the visible positions,
//    base 2 unless the sequence asks for base e.
//  - A row that sees nothing gets output 0 and LSE -inf; never NaN.
//  - fp32 accumulation.
#pragma once

#include <cstdint>

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
  uint8_t causal = 1;      // 1: causal mask
  uint8_t lse_base_e = 0;  // 1: LSE in natural log; 0: base 2
  uint8_t pad_[2] = {0, 0};
};

struct PagedPrefillParams {
  const void* q = nullptr;      // (total_q, num_qo_heads, head_dim), dtype
  void* o = nullptr;            // (total_q, num_qo_heads, head_dim), dtype
  float* lse = nullptr;         // (total_q, num_qo_heads), float32
  const void* k_cache = nullptr;  // (num_layers, num_pages, page_size, num_kv_heads, head_dim)
  const void* v_cache = nullptr;  // same shape as k_cache
  const int32_t* kv_indices = nullptr;  // page ids; sequence s uses
                                        // kv_indices[seqs[s].kv_start ...]
  const PrefillSeq* seqs = nullptr;     // (num_seqs)
  int32_t num_seqs = 0;
  int32_t total_q = 0;          // rows of q / o / lse
  KvGeometry geo;
  // Persistent kernels (PrefillPersistentCtas in kernels/plan/kernel_select.h)
  // launch min(work items, max_ctas) CTAs that loop over the items; 0: one
  // wave (the device's SMs times the kernel's occupancy). The plan's
  // persistent_ctas should match. Tests set a few to run many items per CTA.
  int32_t max_ctas = 0;
};

// CPU reference: computes o and lse for every row of every sequence.
// Multi-threaded (OpenMP). Inputs must already be validated (page ids in
// range, kv_len consistent with the indices).
void PagedPrefillCpu(const PagedPrefillParams& params);

}  // namespace attnserve
