// Host plan of the decode family: see decode_plan.h.
#include "kernels/plan/decode_plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/variant.h"

namespace attnserve {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The keys some row of the sequence sees (kernels/variant.h): with at most
// kMaxDecodeQueryRows rows, every tile's range is about this one.
KeyRange VisibleKeys(const PrefillSeq& s) { return RowsKeys(s, 0, s.q_len - 1).read; }

// Cluster mode: every tile of the planned sequences gets exactly `cluster`
// consecutive items (chunk c of the tile is the cluster's CTA c); tiles
// longest first.
template <typename TilesOf>
void BuildClusterItems(const PrefillSeq* seqs, const std::vector<int32_t>& planned, int32_t kvh_count, int32_t m,
                       const TilesOf& tiles_of, int32_t cluster, DecodePlan* plan) {
  struct Tile {
    int32_t seq, kv_head, row_begin;
    KeyRange keys;
  };
  std::vector<Tile> tiles;
  for (int32_t i : planned) {
    const int32_t nt = tiles_of(seqs[i]);
    for (int32_t kvh = 0; kvh < kvh_count; ++kvh) {
      for (int32_t t = 0; t < nt; ++t) tiles.push_back({i, kvh, t * m, VisibleKeys(seqs[i])});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.keys.size() > b.keys.size(); });
  int32_t longest = 0;
  for (const Tile& t : tiles) {
    const int32_t vis = t.keys.size();
    const int32_t len =
        static_cast<int32_t>(CeilDiv(CeilDiv(vis, cluster), kDecodeChunkQuantum) * kDecodeChunkQuantum);
    longest = std::max(longest, len);
    for (int32_t c = 0; c < cluster; ++c) {
      DecodeWorkItem it;
      it.seq = t.seq;
      it.seq_info = seqs[t.seq];
      it.kv_head = t.kv_head;
      it.row_begin = t.row_begin;
      // Chunks past the visible range are empty (kv_begin == kv_end): their
      // CTA contributes an empty state (LSE -inf; chunk 0 the sink) to the
      // merge.
      it.kv_begin = t.keys.begin + std::min(c * len, vis);
      it.kv_end = t.keys.begin + std::min((c + 1) * len, vis);
      it.chunk = c;
      it.num_chunks = cluster;
      plan->items.push_back(it);
    }
  }
  plan->cluster = cluster;
  plan->chunk_len = longest;
}

}  // namespace

bool DecodeGeometrySupported(const KvGeometry& geo) {
  return (geo.head_dim == 64 || geo.head_dim == 128 || geo.head_dim == 256) &&
         geo.num_kv_heads > 0 && geo.num_qo_heads > 0 &&
         geo.num_qo_heads % geo.num_kv_heads == 0 && geo.page_size > 0;
}

bool DecodeSeqQualifies(const PrefillSeq& seq, const KvGeometry& geo) {
  return seq.q_len >= 1 && seq.q_len <= kMaxDecodeQueryRows && DecodeGeometrySupported(geo);
}

bool DecodeBatchQualifies(const PrefillSeq* seqs, int32_t num_seqs, const KvGeometry& geo) {
  if (!DecodeGeometrySupported(geo)) return false;
  for (int32_t i = 0; i < num_seqs; ++i) {
    if (seqs[i].q_len > 0 && !DecodeSeqQualifies(seqs[i], geo)) return false;
  }
  return true;
}

int32_t SeqsForPrefillFamily(const PrefillSeq* seqs, int32_t num_seqs, const KvGeometry& geo,
                             std::vector<PrefillSeq>* prefill_seqs) {
  prefill_seqs->assign(seqs, seqs + std::max(num_seqs, 0));
  int32_t decode = 0;
  for (PrefillSeq& s : *prefill_seqs) {
    if (DecodeSeqQualifies(s, geo)) {
      s.q_len = 0;
      ++decode;
    }
  }
  return decode;
}

int32_t DecodeTileRows(int32_t head_dim, int32_t max_rows) {
  const int32_t cap = head_dim == 256 ? 16 : 32;
  int32_t m = 16;
  while (m < cap && m < max_rows) m *= 2;
  return m;
}

void BuildDecodePlan(const PrefillSeq* seqs, int32_t num_seqs, const KvGeometry& geo,
                     const DecodePlanOptions& options, DecodePlan* plan) {
  plan->items.clear();
  plan->chunk_len = 0;
  plan->cluster = 0;
  plan->split_tiles = 0;
  plan->partial_slots = 0;
  plan->num_seqs_planned = 0;
  plan->tile_rows = 16;
  if (!DecodeGeometrySupported(geo)) return;
  const int32_t kvh_count = geo.num_kv_heads;
  const int32_t group = geo.num_qo_heads / geo.num_kv_heads;

  // Qualifying sequences and the tile size they need.
  std::vector<int32_t> planned;
  int32_t max_rows = 1;
  for (int32_t i = 0; i < num_seqs; ++i) {
    if (!DecodeSeqQualifies(seqs[i], geo)) continue;
    planned.push_back(i);
    max_rows = std::max(max_rows, seqs[i].q_len * group);
  }
  plan->num_seqs_planned = static_cast<int32_t>(planned.size());
  if (planned.empty()) return;
  const int32_t m = DecodeTileRows(geo.head_dim, max_rows);
  plan->tile_rows = m;
  auto tiles_of = [&](const PrefillSeq& s) { return static_cast<int32_t>(CeilDiv(int64_t{s.q_len} * group, m)); };

  // ---- Chunk length. Candidates: no split, then chunk lengths that cut the
  // longest visible range into k = 2, 3, ... pieces (rounded to the quantum,
  // at least min_chunk). Each is priced by the cost model of
  // DecodePlanOptions (ns): a batch streams at the HBM rate when enough CTAs
  // are in flight, and every wave of resident CTAs costs at least its
  // longest item; a split adds the merge and the partials' traffic. The
  // cheapest wins; a split must save 2%. On an H200, bf16 (132 SMs x 2):
  // 64..256 x 4096 stay unsplit (256 CTAs already stream at the HBM rate),
  // 8 x 128k goes to 8 chunks of 16k (256 CTAs), 1 x 4096 to a cluster of
  // 16 chunks of 256; FP8 (x 3, paired; x 4 past 396 items): 64..512 x
  // 4096 unsplit, 8 x 128k 8 chunks (256 CTAs, one wave).
  const int64_t quantum = kDecodeChunkQuantum;
  const int64_t min_chunk = std::max<int64_t>(quantum, CeilDiv(std::max(options.min_chunk, 1), quantum) * quantum);
  const double token_bytes = 2.0 * geo.head_dim * geo.KvElemBytes();  // K + V of one KV head
  const double hbm = std::max(options.hbm_bytes_per_ns, 1e-3);
  // A CTA on an FP8 pool streams tokens no faster than on a 16-bit one
  // (its dequantization costs what the halved bytes save; H200,
  // bench/results/2026-12-02-fp8-h200.md): the same tokens per ns, half the
  // bytes; one whose warps take two steps an iteration
  // (DecodeStepsPerIter) pair_token_rate times those tokens.
  const bool fp8 = geo.KvIsFp8();
  const double token_rate = std::max(options.cta_bytes_per_ns, 1e-3) * geo.KvElemBytes() / 2.0;
  auto cta_rate_of = [&](bool wide) {
    return token_rate * (DecodeStepsPerIter(geo.head_dim, m, fp8, wide) == 2 ? options.pair_token_rate : 1.0);
  };
  // The kernel a launch of `items` runs: the wide one past the other's
  // resident slots (DecodePlanOptions::wide_ctas_per_sm), not in cluster
  // mode; its slots and a CTA's rate. Cluster mode is priced at the
  // unpaired rate: its CTAs did not stream faster with the pairs (H200, FP8
  // 8 x 128k in clusters of 8, 256 items: 0.327 ms, against 0.266 for the
  // same items split; bench/results/2026-12-04-session26-h200.md).
  const int64_t sms = std::max(options.num_sms, 1);
  const int64_t narrow_slots = sms * std::max(options.ctas_per_sm, 1);
  const int64_t wide_slots = sms * std::max(options.wide_ctas_per_sm, 0);
  int64_t v_max = 0;
  for (int32_t i : planned) v_max = std::max<int64_t>(v_max, VisibleKeys(seqs[i]).size());

  struct Eval {
    bool ok = false;
    double cost = 0;
  };
  // Streaming time (ns) of `tokens` K/V tokens over `items` CTAs whose
  // longest reads `longest` tokens (the model of DecodePlanOptions);
  // cluster: cluster mode (never the wide kernel, the unpaired rate).
  auto stream_ns = [&](double items, double tokens, double longest, bool cluster) {
    const bool wide = !cluster && items > double(narrow_slots) && wide_slots > narrow_slots;
    const double cta_rate = cluster ? token_rate : cta_rate_of(wide);
    const double slots = double(wide ? wide_slots : narrow_slots);
    const double x = items * cta_rate / hbm;
    const double rate = hbm * x / std::pow(1.0 + x * x * x * x, 0.25);
    // Waves: every one costs its longest item at a CTA's share of the HBM
    // rate, and its start.
    const double share = std::min(cta_rate, hbm / std::max(std::min(items, slots), 1.0));
    const double waves = std::ceil(items / slots);
    const double waves_ns = waves * (longest * token_bytes / share + options.wave_start_ns);
    return std::max(tokens * token_bytes / rate, waves_ns);
  };
  auto evaluate = [&](int64_t len) {  // len 0: no split
    Eval e;
    int64_t longest = 0, max_chunks = 1;
    double tokens = 0, items = 0, partial_slots = 0;
    for (int32_t i : planned) {
      const PrefillSeq& s = seqs[i];
      const int64_t vis = VisibleKeys(s).size();
      const int64_t chunks = (len > 0 && vis > len) ? CeilDiv(vis, len) : 1;
      if (chunks > kMaxDecodeChunks) return e;
      const int64_t item_len = chunks > 1 ? len : vis;
      const double tiles = double(kvh_count) * tiles_of(s);
      longest = std::max(longest, item_len);
      tokens += tiles * double(vis);
      items += tiles * double(chunks);
      if (chunks > 1) partial_slots += tiles * double(chunks);
      max_chunks = std::max(max_chunks, chunks);
    }
    if (options.max_partial_slots > 0 && partial_slots > double(options.max_partial_slots)) return e;
    e.cost = stream_ns(items, tokens, double(longest), /*cluster=*/false);
    if (max_chunks > 1) {
      const double partial_bytes = partial_slots * m * (geo.head_dim + 1) * 4.0;
      e.cost += options.merge_ns + options.merge_ns_per_chunk * double(max_chunks) + 2.0 * partial_bytes / hbm;
    }
    e.ok = true;
    return e;
  };

  // Cluster mode with c chunks per tile (each tile's visible range cut into
  // c equal pieces of whole quanta): priced like a split, with the cluster
  // merge in place of the counter, the partials and the last CTA's pass.
  const int32_t max_cluster = std::min(options.max_cluster, kMaxDecodeCluster);
  auto evaluate_cluster = [&](int64_t c) {
    Eval e;
    int64_t longest = 0;
    double tokens = 0, items = 0;
    for (int32_t i : planned) {
      const PrefillSeq& s = seqs[i];
      const int64_t vis = VisibleKeys(s).size();
      const double tiles = double(kvh_count) * tiles_of(s);
      longest = std::max(longest, CeilDiv(CeilDiv(vis, c), quantum) * quantum);
      tokens += tiles * double(vis);
      items += tiles * double(c);
    }
    if (options.max_items > 0 && items > double(options.max_items)) return e;
    e.cost = stream_ns(items, tokens, double(std::min(longest, v_max)), /*cluster=*/true) + options.cluster_merge_ns;
    e.ok = true;
    return e;
  };

  int64_t chunk_len = 0;  // 0: no split
  int32_t cluster = 0;    // > 1: cluster mode
  if (options.force_chunk <= 0 && options.force_cluster > 1 && max_cluster > 1) {
    cluster = std::min(options.force_cluster, max_cluster);
  } else if (options.force_chunk > 0) {
    chunk_len = std::max<int64_t>(quantum, CeilDiv(options.force_chunk, quantum) * quantum);
    if (!evaluate(chunk_len).ok) chunk_len = CeilDiv(CeilDiv(v_max, kMaxDecodeChunks), quantum) * quantum;
    if (!evaluate(chunk_len).ok) chunk_len = 0;
  } else if (!options.no_split && v_max > min_chunk) {
    Eval best = evaluate(0);
    int64_t prev = -1;
    for (int64_t k = 2; k <= kMaxDecodeChunks; ++k) {
      const int64_t len = std::max(min_chunk, CeilDiv(CeilDiv(v_max, k), quantum) * quantum);
      if (len == prev) continue;
      prev = len;
      const Eval e = evaluate(len);
      if (e.ok && e.cost < best.cost * 0.98) {
        best = e;
        chunk_len = len;
      }
      if (len == min_chunk) break;
    }
    for (int64_t c = 2; c <= max_cluster; ++c) {
      if (CeilDiv(v_max, c) < quantum) break;
      const Eval e = evaluate_cluster(c);
      if (e.ok && e.cost < best.cost * 0.98) {
        best = e;
        cluster = static_cast<int32_t>(c);
      }
    }
  }
  if (cluster > 1) {
    BuildClusterItems(seqs, planned, kvh_count, m, tiles_of, cluster, plan);
    return;
  }

  // ---- Items, tile by tile.
  int64_t slot = 0;
  int32_t split_tiles = 0;
  std::vector<int32_t> cost;  // visible tokens per item, for the order
  for (int32_t i : planned) {
    const PrefillSeq& s = seqs[i];
    const KeyRange keys = VisibleKeys(s);
    const int32_t vis = keys.size();
    const int32_t chunks =
        (chunk_len > 0 && vis > chunk_len) ? static_cast<int32_t>(CeilDiv(vis, chunk_len)) : 1;
    const int32_t nt = tiles_of(s);
    for (int32_t kvh = 0; kvh < kvh_count; ++kvh) {
      for (int32_t t = 0; t < nt; ++t) {
        for (int32_t c = 0; c < chunks; ++c) {
          DecodeWorkItem it;
          it.seq = i;
          it.seq_info = s;
          it.kv_head = kvh;
          it.row_begin = t * m;
          it.num_chunks = chunks;
          it.chunk = c;
          if (chunks > 1) {
            it.kv_begin = static_cast<int32_t>(keys.begin + c * chunk_len);
            it.kv_end = static_cast<int32_t>(keys.begin + std::min<int64_t>((c + 1) * chunk_len, vis));
            it.split_tile = split_tiles;
            it.part_begin = static_cast<int32_t>(slot);
          } else {
            // Unsplit: the keys some row sees; the kernel masks per row.
            it.kv_begin = keys.begin;
            it.kv_end = std::max(keys.end, keys.begin);
          }
          plan->items.push_back(it);
          cost.push_back(it.kv_end - it.kv_begin);
        }
        if (chunks > 1) {
          slot += chunks;
          ++split_tiles;
        }
      }
    }
  }
  plan->chunk_len = split_tiles > 0 ? static_cast<int32_t>(chunk_len) : 0;
  plan->split_tiles = split_tiles;
  plan->partial_slots = slot;

  // Longest first, so the tail of the grid holds the short items.
  std::vector<int32_t> order(plan->items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return cost[a] > cost[b]; });
  std::vector<DecodeWorkItem> sorted(order.size());
  for (size_t i = 0; i < order.size(); ++i) sorted[i] = plan->items[order[i]];
  plan->items.swap(sorted);
}

}  // namespace attnserve
