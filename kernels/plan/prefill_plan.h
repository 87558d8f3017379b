// Host plan for the paged prefill families: cuts a validated ragged batch
// into work items (sequence, KV head, packed query tile, KV chunk), splits
// long KV ranges when the batch alone would leave SMs idle, and orders the
// items for L2 locality. Plain C++ (no CUDA): tests/kernels/prefill_plan_test
// runs it on every build.
//
//   PrefillPlanOptions opt = ...;   // from the chosen kernel (kernel_select.h)
//   PrefillPlan plan;
//   BuildPrefillPlan(seqs, num_seqs, geo, opt, &plan);
//   // upload plan.items and plan.merges; launch the family; if anything was
//   // split, the merge family combines plan.merges' partial states.
#pragma once

#include <cstdint>
#include <vector>

#include "common/kv_geometry.h"
#include "kernels/paged_prefill.h"

namespace attnserve {

// One unit of work: (sequence, KV head, packed query tile, KV chunk). A tile's
// rows are (query token, query head within the KV head's group) pairs:
// packed row r of a sequence is token r / group, query head
// kv_head * group + r % group.
struct PrefillWorkItem {
  int32_t seq = 0;        // index into the batch's seqs; -1: padding (no work)
  int32_t kv_head = 0;
  int32_t row_begin = 0;  // first packed row of the tile within the sequence
  int32_t kv_begin = 0;   // KV positions [kv_begin, kv_end) of this chunk
  int32_t kv_end = 0;
  // -1: the item covers the whole KV range and writes o / lse itself.
  // Otherwise the offset, in (row, head) pairs, of this chunk's fp32 partial
  // state: part_o[(part_base + t * num_qo_heads + h) * head_dim + d] and
  // part_lse[part_base + t * num_qo_heads + h] (base-2 LSE), t the token
  // within the sequence.
  int32_t part_base = -1;
  // Which of the tile's chunks this is: chunk 0 carries the sequence's sink
  // (kernels/variant.h: exactly one partial state of a row may).
  int32_t chunk = 0;
};

// A sequence whose KV range was split: the merge pass combines its
// num_chunks partial states (chunk c at part_off + c * q_len * num_qo_heads)
// into o / lse rows q_start .. q_start + q_len.
struct SplitMergeSeq {
  int32_t q_start = 0;
  int32_t q_len = 0;
  int32_t num_chunks = 0;
  int32_t part_off = 0;      // (row, head) pairs
  int32_t pair_begin = 0;    // prefix sum of q_len * num_qo_heads over merges
  int32_t lse_base_e = 0;    // 1: final LSE in natural log
};

struct PrefillPlanOptions {
  int32_t num_sms = 132;
  // Resident CTAs per SM for the kernel chosen (PrefillCtasPerSm in kernels/dispatch.h).
  int32_t ctas_per_sm = 2;
  // Split KV when the unsplit items number fewer than this; 0: 2 waves.
  int32_t target_items = 0;
  // Smallest KV chunk (tokens) worth a work item of its own.
  int32_t min_chunk = 512;
  // Capacity of the partial workspace in (row, head) pairs.
  int64_t max_partial_pairs = 0;
  // Packed rows per tile (PrefillTileRows in kernel_select.h).
  int32_t tile_rows = 128;
  // Items run in sections of whole (sequence, KV head) groups whose K/V
  // bytes sum to at most this, longest first within a section, so that the
  // CTAs in flight share K/V through L2 (a quarter of an H100/H200 L2).
  // 0: one section, plain longest-first order.
  int64_t l2_section_bytes = int64_t{16} << 20;
  // Persistent kernels (PrefillPersistentCtas in kernel_select.h): the CTAs
  // of the grid, which run items c, c + n, c + 2n, ... (n = this). The plan
  // deals the items, in its order, each to the CTA with the least work so
  // far (PersistentItemCost), and lays them out so: CTA c's
  // k-th item at k * n + c, padding items (seq = -1) where a CTA has fewer.
  // 0, or no more items than CTAs: one CTA per item, no padding.
  int32_t persistent_ctas = 0;
  // Entries the plan may hold (0: no limit): a dealt layout that would need
  // more keeps the plain order, which a persistent grid also runs correctly.
  int64_t max_items = 0;
};

// What an item costs a persistent CTA, in KV tokens, when the plan deals
// items to persistent CTAs: its keys in whole blocks of kDealBlock (the
// persistent kernels run whole 128-key blocks, masked where the range or
// the diagonal ends) plus kTileCost for the tile's first turn, epilogue and
// the step to the next tile, which the sm90 kernel's per-tile trace puts at
// about one block's turns (bench/results/2026-12-01-session8-h200.md).
inline constexpr int64_t kDealBlock = 128;
inline constexpr int64_t kTileCost = 128;
inline int64_t PersistentItemCost(int64_t tokens) {
  return (tokens + kDealBlock - 1) / kDealBlock * kDealBlock + kTileCost;
}

struct PrefillPlan {
  std::vector<PrefillWorkItem> items;  // L2 sections, longest first in each
                                       // (dealt to persistent CTAs, padded)
  std::vector<SplitMergeSeq> merges;   // empty when nothing was split
  int64_t partial_pairs = 0;           // partial (row, head) pairs used
  int32_t merge_pairs = 0;             // (row, head) pairs the merge writes
};

// Builds the work items (and split merges) for seqs on the host. Sequences
// with q_len 0 produce no items. Never fails for validated input.
void BuildPrefillPlan(const PrefillSeq* seqs, int32_t num_seqs,
                      const KvGeometry& geo, const PrefillPlanOptions& options,
                      PrefillPlan* plan);

}  // namespace attnserve
