#include "kernels/plan/prefill_plan.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

#include "kernels/variant.h"

namespace attnserve {

void BuildPrefillPlan(const PrefillSeq* seqs, int32_t num_seqs, const KvGeometry& geo,
                      const PrefillPlanOptions& options, PrefillPlan* plan) {
  plan->items.clear();
  plan->merges.clear();
  plan->partial_pairs = 0;
  plan->merge_pairs = 0;
  const int H = geo.num_qo_heads;
  const int KVH = geo.num_kv_heads;
  const int group = H / KVH;
  const int M = options.tile_rows;
  constexpr int kBlock = 64;

  auto tiles_of = [&](const PrefillSeq& s) { return (s.q_len * group + M - 1) / M; };
  // The keys tile `tile` of s reads (kernels/variant.h: its rows' union,
  // clipped by the causal mask and the window), its start rounded down to
  // whole runs of the tensor copy engine (the sm90 family's boxes of
  // `align` rows; the extra keys are masked): a window costs the keys it
  // lets through, not the sequence.
  const int32_t align = [&] {
    const int32_t run = std::min(geo.page_size & -geo.page_size, 128);
    return run >= 8 ? run : 1;
  }();
  auto tile_keys = [&](const PrefillSeq& s, int tile) {
    const int32_t t0 = tile * M / group;
    const int32_t t1 = std::min(s.q_len - 1, (tile * M + M - 1) / group);
    KeyRange r = RowsKeys(s, t0, t1).read;
    if (r.size() == 0) return KeyRange{r.begin, r.begin};
    r.begin = r.begin / align * align;
    return r;
  };
  int64_t base_items = 0;
  int64_t total_work = 0;  // KV tokens summed over unsplit items
  std::vector<int32_t> longest(num_seqs, 0);  // the longest tile range of each sequence
  for (int i = 0; i < num_seqs; ++i) {
    const PrefillSeq& s = seqs[i];
    if (s.q_len <= 0) continue;
    const int nt = tiles_of(s);
    base_items += int64_t{KVH} * nt;
    for (int tile = 0; tile < nt; ++tile) {
      const int32_t keys = tile_keys(s, tile).size();
      longest[i] = std::max(longest[i], keys);
      total_work += int64_t{KVH} * std::max(keys, kBlock);
    }
  }

  // Split only when the batch alone would leave SMs idle.
  const int64_t wave = int64_t{options.num_sms} * std::max(options.ctas_per_sm, 1);
  const int64_t target = options.target_items > 0 ? options.target_items : 2 * wave;
  std::vector<int32_t> chunks(num_seqs, 1);
  int64_t chunk_len = 0;
  if (base_items > 0 && base_items < wave && options.max_partial_pairs > 0) {
    chunk_len = std::max<int64_t>(options.min_chunk, (total_work / target + kBlock - 1) / kBlock * kBlock);
    for (;;) {
      int64_t pairs = 0;
      bool any = false;
      for (int i = 0; i < num_seqs; ++i) {
        const PrefillSeq& s = seqs[i];
        chunks[i] = 1;
        if (s.q_len <= 0 || longest[i] <= chunk_len) continue;
        chunks[i] = static_cast<int32_t>((longest[i] + chunk_len - 1) / chunk_len);
        pairs += int64_t{chunks[i]} * s.q_len * H;
        any = true;
      }
      if (!any) { chunk_len = 0; break; }
      if (pairs <= options.max_partial_pairs && pairs < INT32_MAX) break;
      chunk_len *= 2;
    }
  }

  int64_t part_off = 0;
  int32_t pair_begin = 0;
  for (int i = 0; i < num_seqs; ++i) {
    const PrefillSeq& s = seqs[i];
    if (s.q_len <= 0) continue;
    const int nt = tiles_of(s);
    const int nc = chunks[i];
    if (nc > 1) {
      SplitMergeSeq ms;
      ms.q_start = s.q_start;
      ms.q_len = s.q_len;
      ms.num_chunks = nc;
      ms.part_off = static_cast<int32_t>(part_off);
      ms.pair_begin = pair_begin;
      ms.lse_base_e = s.lse_base_e;
      plan->merges.push_back(ms);
      pair_begin += s.q_len * H;
    }
    for (int kvh = 0; kvh < KVH; ++kvh) {
      for (int tile = 0; tile < nt; ++tile) {
        const KeyRange keys = tile_keys(s, tile);
        // A split tile's range in nc chunks of whole blocks (some may be
        // empty: their items write an empty state, chunk 0 the sink).
        const int64_t len =
            nc > 1 ? (int64_t{keys.size()} + nc - 1) / nc : int64_t{keys.size()};
        const int64_t step = nc > 1 ? (len + kBlock - 1) / kBlock * kBlock : len;
        for (int c = 0; c < nc; ++c) {
          PrefillWorkItem it;
          it.seq = i;
          it.kv_head = kvh;
          it.row_begin = tile * M;
          it.chunk = c;
          it.kv_begin = static_cast<int32_t>(std::min<int64_t>(keys.begin + c * step, keys.end));
          it.kv_end = static_cast<int32_t>(std::min<int64_t>(keys.begin + (c + 1) * step, keys.end));
          if (nc == 1) it.kv_end = keys.end;
          it.part_base = nc > 1 ? static_cast<int32_t>(part_off + int64_t{c} * s.q_len * H) : -1;
          plan->items.push_back(it);
        }
      }
    }
    if (nc > 1) part_off += int64_t{nc} * s.q_len * H;
  }
  plan->partial_pairs = part_off;
  plan->merge_pairs = pair_begin;

  // Order: L2 sections of whole (sequence, KV head) groups, longest item
  // first inside each section. Every tile of a group reads the same K/V rows;
  // a plain global longest-first order runs the same tile of every group at
  // once, so the resident CTAs touch every group's K/V and each tile re-reads
  // it from DRAM (prefix 32x512/4096: 268 MB live against a 60 MB L2). A
  // section holds groups whose K/V bytes sum to at most l2_section_bytes, so
  // the CTAs in flight (about one section) share what is in L2, while the
  // tail of the grid still holds the short items of the last section.
  // An item's keys (its range is already clipped to what its rows see).
  auto cost = [&](const PrefillWorkItem& it) { return std::max(it.kv_end - it.kv_begin, 0); };
  const size_t n = plan->items.size();
  std::vector<int32_t> costs(n);
  for (size_t i = 0; i < n; ++i) costs[i] = cost(plan->items[i]);
  // Items were emitted group by group: [group_begin[g], group_begin[g + 1]).
  std::vector<int32_t> group_begin;
  std::vector<int32_t> group_max;    // longest item of the group (tokens)
  std::vector<int64_t> group_bytes;  // K + V bytes the group reads
  const int64_t token_bytes = int64_t{2} * geo.head_dim * geo.KvElemBytes();  // K and V
  int32_t group_lo = 0, group_hi = 0;  // keys the current group's items read
  for (size_t i = 0; i < n; ++i) {
    const PrefillWorkItem& it = plan->items[i];
    if (i == 0 || it.seq != plan->items[i - 1].seq || it.kv_head != plan->items[i - 1].kv_head) {
      group_begin.push_back(static_cast<int32_t>(i));
      group_max.push_back(0);
      group_bytes.push_back(0);
      group_lo = it.kv_begin;
      group_hi = it.kv_end;
    }
    group_lo = std::min(group_lo, it.kv_begin);
    group_hi = std::max(group_hi, it.kv_end);
    group_bytes.back() = int64_t{std::max(group_hi - group_lo, 0)} * token_bytes;
    group_max.back() = std::max(group_max.back(), costs[i]);
  }
  group_begin.push_back(static_cast<int32_t>(n));
  const int num_groups = static_cast<int>(group_max.size());
  std::vector<int32_t> group_order(num_groups);
  std::iota(group_order.begin(), group_order.end(), 0);
  std::stable_sort(group_order.begin(), group_order.end(),
                   [&](int32_t a, int32_t b) { return group_max[a] > group_max[b]; });

  std::vector<int32_t> order;
  order.reserve(n);
  const int64_t budget = options.l2_section_bytes > 0 ? options.l2_section_bytes : INT64_MAX;
  auto by_cost = [&](int32_t a, int32_t b) { return costs[a] > costs[b]; };
  for (int gi = 0; gi < num_groups;) {
    const size_t section_begin = order.size();
    int64_t bytes = 0;
    do {
      const int32_t g = group_order[gi++];
      bytes += group_bytes[g];
      for (int32_t i = group_begin[g]; i < group_begin[g + 1]; ++i) order.push_back(i);
    } while (gi < num_groups && bytes + group_bytes[group_order[gi]] <= budget);
    std::stable_sort(order.begin() + section_begin, order.end(), by_cost);
  }
  std::vector<PrefillWorkItem> sorted(n);
  for (size_t i = 0; i < n; ++i) sorted[i] = plan->items[order[i]];
  plan->items.swap(sorted);

  // Persistent CTAs: deal the items in this order, each to the least loaded
  // CTA (ties to the lowest index), then lay each CTA's items out with the
  // grid's stride.
  const int64_t ctas = options.persistent_ctas;
  if (ctas <= 0 || static_cast<int64_t>(n) <= ctas) return;
  using Load = std::pair<int64_t, int32_t>;  // (work so far, CTA)
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> least;
  for (int32_t c = 0; c < ctas; ++c) least.push({0, c});
  std::vector<std::vector<int32_t>> dealt(ctas);
  size_t rounds = 0;
  for (size_t i = 0; i < n; ++i) {
    const Load l = least.top();
    least.pop();
    dealt[l.second].push_back(static_cast<int32_t>(i));
    rounds = std::max(rounds, dealt[l.second].size());
    least.push({l.first + PersistentItemCost(costs[order[i]]), l.second});
  }
  const int64_t padded = static_cast<int64_t>(rounds) * ctas;
  if (options.max_items > 0 && padded > options.max_items) return;
  PrefillWorkItem pad;
  pad.seq = -1;
  std::vector<PrefillWorkItem> laid(padded, pad);
  for (int64_t c = 0; c < ctas; ++c) {
    for (size_t k = 0; k < dealt[c].size(); ++k) laid[k * ctas + c] = plan->items[dealt[c][k]];
  }
  plan->items.swap(laid);
}

}  // namespace attnserve
