#include "kernels/plan/prefill_plan.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

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
  int64_t base_items = 0;
  int64_t total_work = 0;  // KV tokens summed over unsplit items
  for (int i = 0; i < num_seqs; ++i) {
    const PrefillSeq& s = seqs[i];
    if (s.q_len <= 0) continue;
    base_items += int64_t{KVH} * tiles_of(s);
    total_work += int64_t{KVH} * tiles_of(s) * std::max(s.kv_len, kBlock);
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
        if (s.q_len <= 0 || s.kv_len <= chunk_len) continue;
        chunks[i] = static_cast<int32_t>((s.kv_len + chunk_len - 1) / chunk_len);
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
        for (int c = 0; c < nc; ++c) {
          PrefillWorkItem it;
          it.seq = i;
          it.kv_head = kvh;
          it.row_begin = tile * M;
          if (nc > 1) {
            it.kv_begin = static_cast<int32_t>(c * chunk_len);
            it.kv_end = static_cast<int32_t>(std::min<int64_t>((c + 1) * chunk_len, s.kv_len));
            it.part_base = static_cast<int32_t>(part_off + int64_t{c} * s.q_len * H);
          } else {
            it.kv_begin = 0;
            it.kv_end = s.kv_len;
            it.part_base = -1;
          }
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
  auto cost = [&](const PrefillWorkItem& it) {
    const PrefillSeq& s = seqs[it.seq];
    int end = it.kv_end;
    if (s.causal) {
      const int t_last = std::min(s.q_len - 1, (it.row_begin + M - 1) / group);
      end = std::min(end, t_last + s.kv_len - s.q_len + s.causal_shift + 1);
    }
    return std::max(end - it.kv_begin, 0);
  };
  const size_t n = plan->items.size();
  std::vector<int32_t> costs(n);
  for (size_t i = 0; i < n; ++i) costs[i] = cost(plan->items[i]);
  // Items were emitted group by group: [group_begin[g], group_begin[g + 1]).
  std::vector<int32_t> group_begin;
  std::vector<int32_t> group_max;    // longest item of the group (tokens)
  std::vector<int64_t> group_bytes;  // K + V bytes the group reads
  const int64_t token_bytes = int64_t{2} * geo.head_dim * KvDTypeBytes(geo.dtype);  // K and V
  for (size_t i = 0; i < n; ++i) {
    const PrefillWorkItem& it = plan->items[i];
    if (i == 0 || it.seq != plan->items[i - 1].seq || it.kv_head != plan->items[i - 1].kv_head) {
      group_begin.push_back(static_cast<int32_t>(i));
      group_max.push_back(0);
      group_bytes.push_back(int64_t{seqs[it.seq].kv_len} * token_bytes);
    }
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
