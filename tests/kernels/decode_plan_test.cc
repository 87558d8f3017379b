// BuildDecodePlan on the host (no GPU): which sequences it takes, that its
// items cover every (sequence, KV head, row tile) exactly once over the
// visible KV range, the split bookkeeping the kernel's merge relies on, and
// the split heuristic on the decode shapes of issue #14.
#include "kernels/plan/decode_plan.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/variant.h"

namespace attnserve {
namespace {

KvGeometry Geo(int h, int kvh, int d, int ps = 16) {
  KvGeometry g;
  g.num_layers = 2;
  g.num_pages = 1 << 20;
  g.page_size = ps;
  g.num_qo_heads = h;
  g.num_kv_heads = kvh;
  g.head_dim = d;
  return g;
}

PrefillSeq Seq(int q_len, int kv_len, bool causal = true, int shift = 0) {
  PrefillSeq s;
  s.q_len = q_len;
  s.kv_len = kv_len;
  s.causal = causal;
  s.causal_shift = shift;
  s.sm_scale = 0.1f;
  return s;
}

// The keys some row of the sequence sees (causal, shift, window), written
// here from the definitions (docs/design.md section 3) rather than taken from
// kernels/variant.h: row t sees [max(0, pos - window_left), min(kv_len,
// pos + 1)) with pos = t + kv_len - q_len + shift (causal), or up to kv_len.
std::pair<int, int> Visible(const PrefillSeq& s) {
  auto row = [&](int t) {
    const int64_t pos = int64_t{t} + s.kv_len - s.q_len + s.causal_shift;
    int64_t lo = s.window_left >= 0 ? std::max<int64_t>(0, pos - s.window_left) : 0;
    int64_t hi = s.causal ? std::min<int64_t>(s.kv_len, pos + 1) : s.kv_len;
    lo = std::min<int64_t>(lo, s.kv_len);
    return std::make_pair(static_cast<int>(lo), static_cast<int>(std::max(hi, lo)));
  };
  const auto first = row(0), last = row(s.q_len - 1);
  return {first.first, std::max(last.second, first.first)};
}
int VisibleKeys(const PrefillSeq& s) { return Visible(s).second - Visible(s).first; }

// Checks every structural property; returns the number of items per tile.
void CheckPlan(const std::vector<PrefillSeq>& seqs, const KvGeometry& g, const DecodePlan& plan) {
  const int group = g.num_qo_heads / g.num_kv_heads;
  const int m = plan.tile_rows;
  ASSERT_TRUE(m == 16 || m == 32);
  int max_rows = 1;
  for (const auto& s : seqs) {
    if (DecodeSeqQualifies(s, g)) max_rows = std::max(max_rows, s.q_len * group);
  }
  EXPECT_EQ(m, DecodeTileRows(g.head_dim, max_rows));
  // (seq, kv_head, row_begin) -> items
  std::map<std::tuple<int, int, int>, std::vector<DecodeWorkItem>> tiles;
  for (const auto& it : plan.items) {
    ASSERT_GE(it.seq, 0);
    ASSERT_LT(it.seq, static_cast<int>(seqs.size()));
    ASSERT_TRUE(DecodeSeqQualifies(seqs[it.seq], g)) << "item for a non-qualifying sequence " << it.seq;
    // The kernel reads the sequence from the item's copy.
    ASSERT_EQ(std::memcmp(&it.seq_info, &seqs[it.seq], sizeof(PrefillSeq)), 0) << "stale seq_info " << it.seq;
    ASSERT_GE(it.kv_head, 0);
    ASSERT_LT(it.kv_head, g.num_kv_heads);
    ASSERT_EQ(it.row_begin % m, 0);
    ASSERT_LT(it.row_begin, seqs[it.seq].q_len * group);
    tiles[{it.seq, it.kv_head, it.row_begin}].push_back(it);
  }
  std::set<int> counters;
  std::vector<int> slot_used(plan.partial_slots, 0);
  for (int i = 0; i < static_cast<int>(seqs.size()); ++i) {
    const PrefillSeq& s = seqs[i];
    if (!DecodeSeqQualifies(s, g)) continue;
    const int nt = (s.q_len * group + m - 1) / m;
    for (int h = 0; h < g.num_kv_heads; ++h) {
      for (int t = 0; t < nt; ++t) {
        auto found = tiles.find({i, h, t * m});
        ASSERT_NE(found, tiles.end()) << "tile missing: seq " << i << " head " << h << " tile " << t;
        std::vector<DecodeWorkItem> items = found->second;
        std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.chunk < b.chunk; });
        const int n = static_cast<int>(items.size());
        ASSERT_LE(n, kMaxDecodeChunks);
        const auto [lo, hi] = Visible(s);
        if (n == 1) {
          EXPECT_EQ(items[0].split_tile, -1);
          EXPECT_EQ(items[0].kv_begin, lo);
          EXPECT_EQ(items[0].kv_end, hi);
          continue;
        }
        // Split: chunks 0..n-1 tile the visible keys [lo, hi) in order.
        int pos = lo;
        for (int c = 0; c < n; ++c) {
          const auto& it = items[c];
          EXPECT_EQ(it.chunk, c);
          EXPECT_EQ(it.num_chunks, n);
          EXPECT_EQ(it.kv_begin, pos);
          EXPECT_GT(it.kv_end, it.kv_begin);
          EXPECT_EQ(it.split_tile, items[0].split_tile);
          EXPECT_EQ(it.part_begin, items[0].part_begin);
          ASSERT_GE(it.part_begin + c, 0);
          ASSERT_LT(it.part_begin + c, plan.partial_slots);
          EXPECT_EQ(slot_used[it.part_begin + c]++, 0) << "partial slot used twice";
          pos = it.kv_end;
        }
        EXPECT_EQ(pos, hi);
        ASSERT_GE(items[0].split_tile, 0);
        ASSERT_LT(items[0].split_tile, plan.split_tiles);
        EXPECT_TRUE(counters.insert(items[0].split_tile).second) << "counter shared by two tiles";
      }
    }
  }
  EXPECT_EQ(static_cast<int>(counters.size()), plan.split_tiles);
  // Longest (visible) chunk first.
  for (size_t i = 1; i < plan.items.size(); ++i) {
    auto len = [&](const DecodeWorkItem& it) { return it.kv_end - it.kv_begin; };
    EXPECT_GE(len(plan.items[i - 1]), len(plan.items[i])) << "item " << i;
  }
}

// Cluster mode: every tile has exactly plan.cluster consecutive items,
// chunk c at grid position tile * cluster + c, the chunks tile [0, visible
// end) in order (the trailing ones may be empty), no partials, no counters;
// tiles longest first.
void CheckClusterPlan(const std::vector<PrefillSeq>& seqs, const KvGeometry& g, const DecodePlan& plan) {
  const int c = plan.cluster;
  ASSERT_GT(c, 1);
  ASSERT_LE(c, kMaxDecodeCluster);
  ASSERT_EQ(plan.items.size() % c, 0u);
  EXPECT_EQ(plan.split_tiles, 0);
  EXPECT_EQ(plan.partial_slots, 0);
  const int group = g.num_qo_heads / g.num_kv_heads;
  const int m = plan.tile_rows;
  std::set<std::tuple<int, int, int>> seen;
  int prev_vis = 1 << 30;
  for (size_t t = 0; t < plan.items.size() / c; ++t) {
    const DecodeWorkItem& first = plan.items[t * c];
    const PrefillSeq& s = seqs[first.seq];
    ASSERT_TRUE(DecodeSeqQualifies(s, g));
    ASSERT_EQ(std::memcmp(&first.seq_info, &s, sizeof(PrefillSeq)), 0);
    EXPECT_TRUE(seen.insert({first.seq, first.kv_head, first.row_begin}).second) << "tile twice";
    const auto [lo, hi] = Visible(s);
    const int vis = hi - lo;
    EXPECT_LE(vis, prev_vis) << "tiles not longest first";
    prev_vis = vis;
    int pos = lo;
    for (int k = 0; k < c; ++k) {
      const DecodeWorkItem& it = plan.items[t * c + k];
      EXPECT_EQ(it.seq, first.seq);
      EXPECT_EQ(it.kv_head, first.kv_head);
      EXPECT_EQ(it.row_begin, first.row_begin);
      EXPECT_EQ(it.chunk, k);
      EXPECT_EQ(it.num_chunks, c);
      EXPECT_EQ(it.split_tile, -1);
      EXPECT_EQ(it.kv_begin, pos);
      EXPECT_GE(it.kv_end, it.kv_begin);
      EXPECT_LE(it.kv_end - it.kv_begin, plan.chunk_len);
      pos = it.kv_end;
    }
    EXPECT_EQ(pos, hi);
  }
  // Every qualifying (sequence, KV head, row tile) once.
  size_t tiles = 0;
  for (const PrefillSeq& s : seqs) {
    if (DecodeSeqQualifies(s, g)) tiles += size_t(g.num_kv_heads) * ((s.q_len * group + m - 1) / m);
  }
  EXPECT_EQ(seen.size(), tiles);
}

DecodePlan Plan(const std::vector<PrefillSeq>& seqs, const KvGeometry& g, DecodePlanOptions opt = {}) {
  DecodePlan plan;
  BuildDecodePlan(seqs.data(), static_cast<int32_t>(seqs.size()), g, opt, &plan);
  return plan;
}

std::vector<PrefillSeq> Uniform(int batch, int q_len, int kv_len) {
  std::vector<PrefillSeq> seqs;
  for (int i = 0; i < batch; ++i) seqs.push_back(Seq(q_len, kv_len));
  return seqs;
}

TEST(DecodePlan, Qualification) {
  const KvGeometry g = Geo(32, 4, 128);
  EXPECT_TRUE(DecodeSeqQualifies(Seq(1, 10), g));
  EXPECT_TRUE(DecodeSeqQualifies(Seq(8, 10), g));
  EXPECT_FALSE(DecodeSeqQualifies(Seq(9, 10), g));
  EXPECT_FALSE(DecodeSeqQualifies(Seq(0, 10), g));
  EXPECT_FALSE(DecodeSeqQualifies(Seq(1, 10), Geo(32, 4, 96)));
  EXPECT_FALSE(DecodeSeqQualifies(Seq(1, 10), Geo(32, 5, 128)));
  std::vector<PrefillSeq> mixed = {Seq(1, 100), Seq(0, 5), Seq(4, 100)};
  EXPECT_TRUE(DecodeBatchQualifies(mixed.data(), 3, g));
  mixed.push_back(Seq(100, 300));
  EXPECT_FALSE(DecodeBatchQualifies(mixed.data(), 4, g));
  // The plan takes the qualifying sequences only.
  const DecodePlan plan = Plan(mixed, g);
  EXPECT_EQ(plan.num_seqs_planned, 2);
  for (const auto& it : plan.items) EXPECT_TRUE(it.seq == 0 || it.seq == 2);
  CheckPlan(mixed, g, plan);
}

TEST(DecodePlan, MixedBatchSplitsIntoTwoFamilies) {
  const KvGeometry g = Geo(32, 4, 128);
  const std::vector<PrefillSeq> seqs = {Seq(1, 100), Seq(300, 900), Seq(8, 50), Seq(0, 7), Seq(9, 9)};
  std::vector<PrefillSeq> rest;
  EXPECT_EQ(SeqsForPrefillFamily(seqs.data(), 5, g, &rest), 2);
  ASSERT_EQ(rest.size(), 5u);
  const int want_q[] = {0, 300, 0, 0, 9};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(rest[i].q_len, want_q[i]) << i;
    EXPECT_EQ(rest[i].kv_len, seqs[i].kv_len) << i;
  }
  // Every sequence with rows is in exactly one family.
  const DecodePlan plan = Plan(seqs, g);
  std::set<int> decode_seqs;
  for (const auto& it : plan.items) decode_seqs.insert(it.seq);
  EXPECT_EQ(decode_seqs, (std::set<int>{0, 2}));
  // Unsupported head_dim: everything stays with prefill.
  EXPECT_EQ(SeqsForPrefillFamily(seqs.data(), 5, Geo(32, 4, 96), &rest), 0);
  EXPECT_EQ(rest[0].q_len, 1);
}

TEST(DecodePlan, TileRows) {
  EXPECT_EQ(DecodeTileRows(128, 1), 16);
  EXPECT_EQ(DecodeTileRows(128, 8), 16);
  EXPECT_EQ(DecodeTileRows(128, 17), 32);
  EXPECT_EQ(DecodeTileRows(128, 64), 32);  // capped: two tiles per sequence
  EXPECT_EQ(DecodeTileRows(64, 64), 32);
  EXPECT_EQ(DecodeTileRows(64, 20), 32);
  EXPECT_EQ(DecodeTileRows(256, 32), 16);
  // 32 / 4 heads, 8 rows, head_dim 128: 64 packed rows in two tiles of 32.
  const KvGeometry g = Geo(32, 4, 128);
  const std::vector<PrefillSeq> seqs = {Seq(8, 500)};
  const DecodePlan plan = Plan(seqs, g);
  EXPECT_EQ(plan.tile_rows, 32);
  CheckPlan(seqs, g, plan);
}

TEST(DecodePlan, HeuristicOnIssueShapes) {
  const KvGeometry g = Geo(32, 4, 128, 1);
  DecodePlanOptions opt;
  opt.num_sms = 132;
  opt.ctas_per_sm = 2;
  // 64 x 4096: 256 tiles already fill 264 slots: no split.
  {
    const auto seqs = Uniform(64, 1, 4096);
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_EQ(p.split_tiles, 0);
    EXPECT_EQ(p.items.size(), 256u);
    CheckPlan(seqs, g, p);
  }
  // 256 x 4096: 1024 tiles, about 4 waves: no split.
  {
    const auto seqs = Uniform(256, 1, 4096);
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_EQ(p.split_tiles, 0);
    CheckPlan(seqs, g, p);
  }
  // 8 x 131072: 32 tiles; split so that enough CTAs stream at the HBM rate
  // (at least about one per SM), never beyond the 264 slots.
  {
    const auto seqs = Uniform(8, 1, 131072);
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_EQ(p.split_tiles, 32);
    EXPECT_GE(p.items.size(), 128u);
    EXPECT_LE(p.items.size(), 264u);
    CheckPlan(seqs, g, p);
  }
  // 1 x 4096: 4 tiles; split into chunks of a few ring fills: more than 8
  // per tile (one CTA alone streams a 4096 range too slowly), fewer than the
  // 22 that made the merge 42% of the time in the first H200 run.
  {
    const auto seqs = Uniform(1, 1, 4096);
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_EQ(p.split_tiles, 4);
    EXPECT_GT(p.items.size(), 32u);
    EXPECT_LT(p.items.size(), 88u);
    EXPECT_GE(p.chunk_len, opt.min_chunk);
    CheckPlan(seqs, g, p);
  }
  // Speculative 64 x 4 rows: 32 packed rows in one tile, no split.
  {
    const auto seqs = Uniform(64, 4, 4096);
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_EQ(p.tile_rows, 32);
    EXPECT_EQ(p.items.size(), 256u);
    CheckPlan(seqs, g, p);
  }
}

// FP8 pools on an H200 (3 CTAs an SM: 396 slots), the shapes of issue #32,
// against the chunk sweep of bench/results/2026-12-03-session16-h200.md: a
// launch of more items than slots pays a whole wave for its last one.
TEST(DecodePlan, Fp8PlansKeepToOneWaveWhereTheSweepDid) {
  KvGeometry g = Geo(32, 4, 128, 1);
  g.kv_fp8 = Fp8Format::kE4m3;
  DecodePlanOptions opt;
  opt.num_sms = 132;
  opt.ctas_per_sm = 3;
  opt.max_cluster = 16;
  const int64_t slots = 396;
  // 64 x 4096: unsplit (256 items: 0.085 ms; 512 in 2 chunks or a cluster
  // of 2, the plan's earlier choice, 0.103-0.105; 768: 0.090).
  {
    const auto seqs = Uniform(64, 1, 4096);
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_EQ(p.split_tiles, 0);
    EXPECT_LE(p.cluster, 1);
    EXPECT_EQ(p.items.size(), 256u);
    CheckPlan(seqs, g, p);
  }
  // 256 x 4096: unsplit (1024 items 0.285 ms; 2048 0.318).
  {
    const auto seqs = Uniform(256, 1, 4096);
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_EQ(p.split_tiles, 0);
    EXPECT_LE(p.cluster, 1);
    CheckPlan(seqs, g, p);
  }
  // 8 x 131072: split into one wave of at least 256 items (256: 0.299 ms;
  // 576, the earlier choice, 0.310; 512: 0.345; 192: 0.373).
  {
    const auto seqs = Uniform(8, 1, 131072);
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_GE(p.items.size(), 256u);
    EXPECT_LE(static_cast<int64_t>(p.items.size()), slots);
    if (p.cluster > 1) CheckClusterPlan(seqs, g, p); else CheckPlan(seqs, g, p);
  }
  // 1 x 4096: still cut into many short items (a cluster of 16: 0.015 ms;
  // unsplit 0.059).
  {
    const auto seqs = Uniform(1, 1, 4096);
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_GE(p.items.size(), 32u);
    if (p.cluster > 1) CheckClusterPlan(seqs, g, p); else CheckPlan(seqs, g, p);
  }
}

// The same with the wide kernel priced (four CTAs an SM past the three-CTA
// kernel's 396 slots, DecodePlanOptions::wide_ctas_per_sm) and the
// three-CTA kernel's step pairs (pair_token_rate): batches of 397..528
// tiles stay unsplit in one wave of it (128 x 4096: 512 items
// 0.137 ms against 1,536 split items 0.160 on the H200,
// bench/results/2026-12-04-session26-h200.md); what fits three CTAs an SM
// plans as before; cluster plans never count on it (the launch does not
// run it in cluster mode).
TEST(DecodePlan, Fp8PlansPriceTheWideKernelPastTheNarrowSlots) {
  KvGeometry g = Geo(32, 4, 128, 1);
  g.kv_fp8 = Fp8Format::kE4m3;
  DecodePlanOptions narrow;
  narrow.num_sms = 132;
  narrow.ctas_per_sm = 3;
  narrow.max_cluster = 16;
  DecodePlanOptions wide = narrow;
  wide.wide_ctas_per_sm = 4;
  for (int batch : {100, 128}) {
    const auto seqs = Uniform(batch, 1, 4096);
    const DecodePlan p = Plan(seqs, g, wide);
    EXPECT_EQ(p.split_tiles, 0) << batch;
    EXPECT_LE(p.cluster, 1) << batch;
    EXPECT_EQ(p.items.size(), static_cast<size_t>(batch) * 4) << batch;
    CheckPlan(seqs, g, p);
    // Without it, the same batch is cut (into clusters) for more waves of
    // three.
    const DecodePlan q = Plan(seqs, g, narrow);
    EXPECT_GT(q.items.size(), p.items.size()) << batch;
  }
  for (int batch : {1, 8, 64, 256}) {
    const auto seqs = Uniform(batch, 1, batch == 8 ? 131072 : 4096);
    const DecodePlan p = Plan(seqs, g, wide);
    const DecodePlan q = Plan(seqs, g, narrow);
    if (batch != 8) {  // 8 x 128k: one wave either way (below)
      EXPECT_EQ(p.items.size(), q.items.size()) << batch;
      EXPECT_EQ(p.chunk_len, q.chunk_len) << batch;
      EXPECT_EQ(p.cluster, q.cluster) << batch;
    }
    if (p.cluster > 1) CheckClusterPlan(seqs, g, p); else CheckPlan(seqs, g, p);
  }
  // 8 x 131072: 256 split items, the best of the chunk sweep with the
  // paired kernel (0.266 ms; 384 items 0.272, 512 0.268; clusters of 8
  // 0.327).
  {
    const auto seqs = Uniform(8, 1, 131072);
    const DecodePlan p = Plan(seqs, g, wide);
    EXPECT_EQ(p.items.size(), 256u);
    EXPECT_LE(p.cluster, 1);
  }
  // A wide kernel no wider than the narrow one changes nothing.
  DecodePlanOptions same = narrow;
  same.wide_ctas_per_sm = 3;
  const auto seqs = Uniform(128, 1, 4096);
  EXPECT_EQ(Plan(seqs, g, same).items.size(), Plan(seqs, g, narrow).items.size());
}

TEST(DecodePlan, ForcedAndDisabledSplit) {
  const KvGeometry g = Geo(8, 2, 64, 16);
  const std::vector<PrefillSeq> seqs = {Seq(1, 1000), Seq(3, 64), Seq(2, 65), Seq(1, 1), Seq(1, 0)};
  DecodePlanOptions opt;
  opt.force_chunk = 100;  // rounded up to 128
  DecodePlan p = Plan(seqs, g, opt);
  EXPECT_EQ(p.chunk_len, 128);
  CheckPlan(seqs, g, p);
  EXPECT_EQ(p.split_tiles, 2);  // seq 0, both KV heads
  opt = {};
  opt.no_split = true;
  p = Plan(seqs, g, opt);
  EXPECT_EQ(p.split_tiles, 0);
  CheckPlan(seqs, g, p);
}

TEST(DecodePlan, CausalShiftClipsTheSplitRange) {
  const KvGeometry g = Geo(4, 4, 128, 1);
  // The last row sees keys < 1000 - 300 = 700; nothing, when shifted past.
  const std::vector<PrefillSeq> seqs = {Seq(2, 1000, true, -300), Seq(1, 1000, true, -2000),
                                        Seq(1, 1000, false, -300), Seq(4, 1000, true, 5)};
  DecodePlanOptions opt;
  opt.force_chunk = 256;
  const DecodePlan p = Plan(seqs, g, opt);
  CheckPlan(seqs, g, p);
  for (const auto& it : p.items) {
    if (it.seq == 0) EXPECT_LE(it.kv_end, 700);
    if (it.seq == 1) {
      EXPECT_EQ(it.split_tile, -1);  // one unsplit item that writes zeros
    }
  }
}

TEST(DecodePlan, RandomBatches) {
  std::mt19937_64 rng(14);
  for (int iter = 0; iter < 300; ++iter) {
    const int dims[] = {64, 128, 256};
    const int heads[][2] = {{4, 4}, {8, 2}, {32, 4}, {64, 8}, {16, 1}};
    const int* hh = heads[rng() % 5];
    const KvGeometry g = Geo(hh[0], hh[1], dims[rng() % 3], 1 << (rng() % 7));
    std::vector<PrefillSeq> seqs;
    const int n = 1 + rng() % 40;
    for (int i = 0; i < n; ++i) {
      const int q = rng() % 11;
      const int kv = rng() % 4 == 0 ? static_cast<int>(rng() % 200000) : static_cast<int>(rng() % 5000);
      seqs.push_back(Seq(q, kv, rng() % 3 != 0, static_cast<int>(rng() % 200) - 150));
      // Windows: none mostly; 0, a block, short, long.
      const int w = static_cast<int>(rng() % 8);
      if (w < 4) seqs.back().window_left = w == 0 ? 0 : w == 1 ? 128 : static_cast<int>(rng() % (w == 2 ? 300 : 50000));
    }
    DecodePlanOptions opt;
    opt.num_sms = 1 + rng() % 140;
    opt.ctas_per_sm = 1 + rng() % 3;
    if (rng() % 4 == 0) opt.force_chunk = 1 + rng() % 3000;
    const DecodePlan p = Plan(seqs, g, opt);
    SCOPED_TRACE(iter);
    CheckPlan(seqs, g, p);
    if (HasFatalFailure()) return;
  }
}

// Cluster mode is chosen only where the merge's round trips dominate (small
// batches) and only when the device has clusters; forced sizes, empty
// chunks, the item bound.
TEST(DecodePlan, ClusterMode) {
  const KvGeometry g = Geo(32, 4, 128, 1);
  DecodePlanOptions opt;
  opt.num_sms = 132;
  opt.ctas_per_sm = 2;
  opt.max_cluster = 16;
  {
    const auto seqs = Uniform(1, 1, 4096);  // latency: 4 tiles
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_GT(p.cluster, 1);
    CheckClusterPlan(seqs, g, p);
    DecodePlanOptions no = opt;
    no.max_cluster = 0;  // a GPU without clusters: the counter merge
    const DecodePlan q = Plan(seqs, g, no);
    EXPECT_EQ(q.cluster, 0);
    EXPECT_GT(q.split_tiles, 0);
    CheckPlan(seqs, g, q);
  }
  {
    const auto seqs = Uniform(64, 1, 4096);  // 256 tiles fill the GPU: no split at all
    const DecodePlan p = Plan(seqs, g, opt);
    EXPECT_EQ(p.cluster, 0);
    EXPECT_EQ(p.split_tiles, 0);
    CheckPlan(seqs, g, p);
  }
  // Forced, with sequences shorter than a chunk (empty trailing chunks), no
  // keys, causal_shift and a non-qualifying prefill sequence.
  const KvGeometry g2 = Geo(8, 2, 64, 16);
  const std::vector<PrefillSeq> seqs = {Seq(1, 1000), Seq(3, 64), Seq(2, 65, true, -30), Seq(1, 1),
                                        Seq(1, 0),    Seq(20, 300), Seq(8, 5000, false)};
  for (int c : {2, 3, 8, 16}) {
    DecodePlanOptions f;
    f.max_cluster = 16;
    f.force_cluster = c;
    const DecodePlan p = Plan(seqs, g2, f);
    EXPECT_EQ(p.cluster, c);
    CheckClusterPlan(seqs, g2, p);
  }
  DecodePlanOptions f;
  f.max_cluster = 4;
  f.force_cluster = 16;  // clamped to the device's size
  EXPECT_EQ(Plan(seqs, g2, f).cluster, 4);
  f.max_cluster = 0;  // no clusters: forcing does nothing
  EXPECT_EQ(Plan(seqs, g2, f).cluster, 0);
  // The item bound excludes cluster plans that do not fit.
  DecodePlanOptions b = opt;
  b.max_items = 8;
  const auto one = Uniform(1, 1, 4096);
  const DecodePlan p = Plan(one, g, b);
  EXPECT_TRUE(p.cluster == 0 || p.items.size() <= 8u);
}

// A window costs the keys it lets through: 64 sequences over 32k keys with a
// 128-key window plan as decode over 129 keys, starting at the window.
TEST(DecodePlan, AWindowCostsItsKeysNotTheSequence) {
  const KvGeometry g = Geo(32, 4, 128, 1);
  std::vector<PrefillSeq> windowed = Uniform(64, 1, 32768);
  for (PrefillSeq& s : windowed) s.window_left = 128;
  const DecodePlan p = Plan(windowed, g);
  CheckPlan(windowed, g, p);
  EXPECT_EQ(p.split_tiles, 0);
  for (const DecodeWorkItem& it : p.items) {
    EXPECT_EQ(it.kv_begin, 32768 - 129);
    EXPECT_EQ(it.kv_end, 32768);
  }
  const DecodePlan short_plan = Plan(Uniform(64, 1, 129), g);
  EXPECT_EQ(p.items.size(), short_plan.items.size());
}

}  // namespace
}  // namespace attnserve
