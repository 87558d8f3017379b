// Property checks of BuildPrefillPlan (kernels/plan/prefill_plan.cc),
// on random multi-request batches shaped like the server's: several tasks of
// 2-5 sequences each flattened into one batch (q_len 0 dropped), decode-like
// and prefill-like, causal and not, q_len > kv_len, empty KV, one long KV.
// Plain host code: runs in every build, with or without CUDA.
//
// Checked for every plan: the items of each (sequence, KV head, packed row)
// have consecutive, disjoint key ranges inside [0, kv_len) whose union holds
// every key the row sees (kernels/variant.h: causal, shift, window) and
// reads no key before the tile's first visible one, rounded down to the
// tensor copy engine's run (so a window costs its keys, not the sequence);
// exactly one of them is chunk 0 (it carries the sink); split items write
// each partial (row, head) pair exactly once, inside [0, partial_pairs); the
// merges' pair_begin / part_off / num_chunks match the items that wrote the
// partials, in key order; every output (row, head) of the batch is written
// exactly once, by a final item or by a merge.
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/plan/kernel_select.h"
#include "kernels/plan/prefill_plan.h"
#include "kernels/variant.h"

namespace attnserve {
namespace {

struct Batch {
  KvGeometry geo;
  std::vector<PrefillSeq> seqs;  // flattened, q_len > 0 only (as the CUDA backend packs them)
  int32_t total_q = 0;           // rows of o, including dropped sequences' (none)
};

// One server batch: `tasks` requests of 2-5 sequences each, offsets shifted
// exactly as the CUDA backend's batch packer does.
Batch RandomBatch(std::mt19937_64& gen, const KvGeometry& geo, int tasks, bool mixed) {
  Batch b;
  b.geo = geo;
  int32_t total_idx = 0;
  for (int t = 0; t < tasks; ++t) {
    const int n = 2 + static_cast<int>(gen() % 4);
    const bool decode = mixed ? gen() % 2 == 0 : false;
    const int32_t max_q = decode ? 1 : 256;
    const bool causal = gen() % 5 != 0;
    int32_t q = 0, idx = 0;
    for (int i = 0; i < n; ++i) {
      PrefillSeq s;
      s.q_len = static_cast<int32_t>(gen() % (max_q + 1));
      s.kv_len = static_cast<int32_t>(gen() % 1025);
      const int32_t pages = (s.kv_len + geo.page_size - 1) / geo.page_size;
      s.q_start = q + b.total_q;
      s.kv_start = idx + total_idx;
      s.layer = t % 3;
      s.sm_scale = 0.088f;
      s.causal = causal;
      // A server holding part of a context-parallel sequence's keys.
      if (gen() % 4 == 0) s.causal_shift = static_cast<int32_t>(gen() % 600) - 100;
      // Sliding windows: none mostly; 0, 1, a block, short, long.
      switch (gen() % 8) {
        case 0: s.window_left = 0; break;
        case 1: s.window_left = 1; break;
        case 2: s.window_left = 128; break;
        case 3: s.window_left = static_cast<int32_t>(gen() % 300); break;
        case 4: s.window_left = static_cast<int32_t>(gen() % 5000); break;
        default: break;
      }
      s.lse_base_e = static_cast<uint8_t>(gen() % 2);
      q += s.q_len;
      idx += pages;
      if (s.q_len > 0) b.seqs.push_back(s);
    }
    b.total_q += q;
    total_idx += idx;
  }
  return b;
}

PrefillPlanOptions ServerOptions(int32_t tile_rows, int32_t ctas_per_sm, int64_t l2) {
  PrefillPlanOptions o;
  o.num_sms = 132;
  o.ctas_per_sm = ctas_per_sm;
  o.min_chunk = 512;
  o.tile_rows = tile_rows;
  o.max_partial_pairs = std::max<int64_t>(int64_t{4} * 132 * ctas_per_sm * 128, 1 << 16);
  o.l2_section_bytes = l2;
  return o;
}

// Returns "" when every property holds, else the first violation.
std::string CheckPlan(const Batch& b, const PrefillPlanOptions& opt, const PrefillPlan& plan) {
  const int H = b.geo.num_qo_heads, KVH = b.geo.num_kv_heads, group = H / KVH;
  const int M = opt.tile_rows;
  const int num_seqs = static_cast<int>(b.seqs.size());
  auto fail = [](const std::string& what, int i) { return what + " (item/merge " + std::to_string(i) + ")"; };

  // Per (seq, kvh, packed row): KV intervals seen. Per output (row, head):
  // writers. Per partial pair: writer item.
  std::vector<std::vector<std::vector<std::pair<int, int>>>> ranges(num_seqs);
  for (int s = 0; s < num_seqs; ++s) ranges[s].resize(int64_t{KVH} * b.seqs[s].q_len * group);
  std::vector<int> o_writes(int64_t{b.total_q} * H, 0);
  if (plan.partial_pairs < 0) return "negative partial_pairs";
  if (plan.partial_pairs > opt.max_partial_pairs) return "partial_pairs over the workspace";
  std::vector<int> part_writer(plan.partial_pairs, -1);
  std::vector<std::vector<int>> sink_carriers(b.total_q, std::vector<int>(H, 0));

  for (int i = 0; i < static_cast<int>(plan.items.size()); ++i) {
    const PrefillWorkItem& it = plan.items[i];
    if (it.seq == -1) {
      if (opt.persistent_ctas <= 0) return fail("padding in a plan of one CTA per item", i);
      continue;
    }
    if (it.seq < 0 || it.seq >= num_seqs) return fail("seq out of range", i);
    const PrefillSeq& s = b.seqs[it.seq];
    if (it.kv_head < 0 || it.kv_head >= KVH) return fail("kv_head out of range", i);
    if (it.row_begin < 0 || it.row_begin % M != 0 || it.row_begin >= s.q_len * group) {
      return fail("row_begin", i);
    }
    if (it.kv_begin < 0 || it.kv_end > s.kv_len || it.kv_begin > it.kv_end) {
      return fail("kv range", i);
    }
    const int t_first = it.row_begin / group;
    const int t_last = std::min(s.q_len - 1, (it.row_begin + M - 1) / group);
    const KeyRange read = RowsKeys(s, t_first, t_last).read;
    const int run = std::min(b.geo.page_size & -b.geo.page_size, 128);
    const int align = run >= 8 ? run : 1;
    if (it.kv_begin < read.begin / align * align && it.kv_begin < it.kv_end) {
      return fail("item reads keys before its tile's first visible one", i);
    }
    if (it.kv_end > std::max(read.end, read.begin)) return fail("item reads past its tile's keys", i);
    for (int r = it.row_begin; r < it.row_begin + M; ++r) {
      const int t = r / group;
      if (t >= s.q_len) break;
      const int head = it.kv_head * group + r % group;
      if (it.chunk == 0) ++sink_carriers[s.q_start + t][head];
      ranges[it.seq][(int64_t{it.kv_head} * s.q_len * group) + r].push_back({it.kv_begin, it.kv_end});
      if (it.part_base < 0) {
        ++o_writes[int64_t{s.q_start + t} * H + head];
      } else {
        const int64_t pair = int64_t{it.part_base} + int64_t{t} * H + head;
        if (pair < 0 || pair >= plan.partial_pairs) return fail("partial pair outside [0, partial_pairs)", i);
        if (part_writer[pair] >= 0) return fail("partial pair written twice", i);
        part_writer[pair] = i;
      }
    }
  }
  // Per row: consecutive disjoint ranges holding every key the row sees.
  for (int si = 0; si < num_seqs; ++si) {
    const PrefillSeq& seq = b.seqs[si];
    for (int64_t k = 0; k < static_cast<int64_t>(ranges[si].size()); ++k) {
      auto& v = ranges[si][k];
      const int32_t t = static_cast<int32_t>((k % (int64_t{seq.q_len} * group)) / group);
      const KeyRange sees = RowKeys(seq, t);
      if (v.empty()) return "no item for a row of seq " + std::to_string(si);
      std::sort(v.begin(), v.end());
      for (size_t j = 1; j < v.size(); ++j) {
        if (v[j].first != v[j - 1].second) return "KV gap or overlap in seq " + std::to_string(si);
      }
      if (sees.size() > 0 && (v.front().first > sees.begin || v.back().second < sees.end)) {
        return "a key the row sees is in no item, seq " + std::to_string(si);
      }
    }
  }
  for (const PrefillSeq& seq : b.seqs) {
    for (int32_t t = 0; t < seq.q_len; ++t) {
      for (int h = 0; h < H; ++h) {
        if (sink_carriers[seq.q_start + t][h] != 1) return "a row's sink carried other than once";
      }
    }
  }
  // Merges.
  int32_t pair_begin = 0;
  for (int m = 0; m < static_cast<int>(plan.merges.size()); ++m) {
    const SplitMergeSeq& ms = plan.merges[m];
    if (ms.pair_begin != pair_begin) return fail("pair_begin not the prefix sum", m);
    if (ms.num_chunks < 2 || ms.q_len <= 0) return fail("merge shape", m);
    const int64_t chunk_stride = int64_t{ms.q_len} * H;
    if (ms.part_off < 0 || ms.part_off + ms.num_chunks * chunk_stride > plan.partial_pairs) {
      return fail("merge reads outside the partials", m);
    }
    int seq = -1;
    for (int s = 0; s < num_seqs; ++s) {
      if (b.seqs[s].q_start == ms.q_start && b.seqs[s].q_len == ms.q_len) seq = s;
    }
    if (seq < 0) return fail("merge of no sequence", m);
    if (ms.lse_base_e != b.seqs[seq].lse_base_e) return fail("merge lse base", m);
    for (int64_t local = 0; local < chunk_stride; ++local) {
      int prev_end = -1;
      for (int c = 0; c < ms.num_chunks; ++c) {
        const int w = part_writer[ms.part_off + local + c * chunk_stride];
        if (w < 0) return fail("merge reads a partial no item wrote", m);
        const PrefillWorkItem& it = plan.items[w];
        if (it.seq != seq) return fail("merge reads another sequence's partial", m);
        if (it.kv_head != (local % H) / group) return fail("merge reads another head's partial", m);
        if (it.chunk != c) return fail("merge chunk index", m);
        if (prev_end >= 0 && it.kv_begin != prev_end) return fail("merge chunks out of KV order", m);
        prev_end = it.kv_end;
      }
      const int64_t t = local / H, head = local % H;
      ++o_writes[(ms.q_start + t) * H + head];
    }
    pair_begin += ms.q_len * H;
  }
  if (plan.merge_pairs != pair_begin) return "merge_pairs is not the sum of the merges";
  for (int64_t p = 0; p < plan.partial_pairs; ++p) {
    if (part_writer[p] < 0) return "partial pair never written: " + std::to_string(p);
  }
  for (size_t r = 0; r < o_writes.size(); ++r) {
    if (o_writes[r] != 1) {
      return "output (row, head) " + std::to_string(r) + " written " + std::to_string(o_writes[r]) + " times";
    }
  }
  return "";
}

KvGeometry Geo(int32_t H, int32_t KVH, int32_t D, int32_t page_size) {
  KvGeometry g;
  g.num_layers = 3;
  g.num_pages = 40000;
  g.page_size = page_size;
  g.num_qo_heads = H;
  g.num_kv_heads = KVH;
  g.head_dim = D;
  return g;
}

// The failing shape: 16 x 2 heads, D 128, page 16; 1-12 requests per batch.
TEST(PrefillPlan, MultiRequestBatchesLikeTheConcurrentServerTest) {
  std::mt19937_64 gen(7);
  const KvGeometry g = Geo(16, 2, 128, 16);
  int split_batches = 0, multi_split = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int tasks = 1 + trial % 12;
    Batch b = RandomBatch(gen, g, tasks, /*mixed=*/true);
    // The kernel the server would pick for the batch.
    int64_t max_packed = 0;
    for (const PrefillSeq& s : b.seqs) max_packed = std::max<int64_t>(max_packed, int64_t{s.q_len} * 8);
    const PrefillKernel kernel = ChoosePrefillKernel(g, PrefillDevice{}, max_packed);
    for (int ctas : {1, 2, 3}) {
      for (int64_t l2 : {int64_t{16} << 20, int64_t{0}, int64_t{1} << 20}) {
        const PrefillPlanOptions opt = ServerOptions(PrefillTileRows(kernel, 128), ctas, l2);
        PrefillPlan plan;
        BuildPrefillPlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, opt, &plan);
        const std::string err = CheckPlan(b, opt, plan);
        ASSERT_EQ(err, "") << "trial " << trial << " ctas " << ctas << " l2 " << l2;
        split_batches += !plan.merges.empty();
        multi_split += plan.merges.size() > 1;
      }
    }
  }
  // The shapes must exercise what the server test did: split batches with
  // several split sequences.
  EXPECT_GT(split_batches, 100);
  EXPECT_GT(multi_split, 50);
}

TEST(PrefillPlan, OtherGeometriesAndTileSizes) {
  std::mt19937_64 gen(8);
  const KvGeometry geos[] = {Geo(32, 4, 128, 1), Geo(16, 16, 64, 64), Geo(16, 2, 64, 16),
                             Geo(8, 1, 256, 1), Geo(8, 2, 256, 16)};
  for (const KvGeometry& g : geos) {
    for (int trial = 0; trial < 60; ++trial) {
      Batch b = RandomBatch(gen, g, 1 + trial % 8, trial % 3 != 0);
      for (PrefillKernel kernel : {PrefillKernel::kSm80, PrefillKernel::kSm80Rows64}) {
        const PrefillPlanOptions opt = ServerOptions(PrefillTileRows(kernel, g.head_dim), 1 + trial % 3, int64_t{16} << 20);
        PrefillPlan plan;
        BuildPrefillPlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, opt, &plan);
        ASSERT_EQ(CheckPlan(b, opt, plan), "") << "H " << g.num_qo_heads << " KVH " << g.num_kv_heads
                                               << " D " << g.head_dim << " trial " << trial;
      }
    }
  }
}

// One long KV beside short sequences (the 70,000-token case plus neighbours),
// and a small partial workspace that forces chunk_len to double.
TEST(PrefillPlan, LongKvBesideShortAndSmallWorkspace) {
  std::mt19937_64 gen(9);
  const KvGeometry g = Geo(16, 2, 128, 16);
  for (int trial = 0; trial < 40; ++trial) {
    Batch b = RandomBatch(gen, g, 1 + trial % 4, true);
    PrefillSeq longs;
    longs.q_start = b.total_q;
    longs.q_len = 1 + static_cast<int32_t>(gen() % 64);
    longs.kv_len = 70000;
    longs.causal = trial % 2;
    b.seqs.push_back(longs);
    b.total_q += longs.q_len;
    for (int64_t cap : {int64_t{0}, int64_t{1} << 16, int64_t{4096}}) {
      PrefillPlanOptions opt = ServerOptions(PrefillTileRows(PrefillKernel::kSm80, 128), 2, int64_t{16} << 20);
      if (cap > 0) opt.max_partial_pairs = cap;
      PrefillPlan plan;
      BuildPrefillPlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, opt, &plan);
      ASSERT_EQ(CheckPlan(b, opt, plan), "") << "trial " << trial << " cap " << cap;
    }
  }
}

// KV tokens an item's tile reads (the kernel's causal clipping), as the plan
// counts an item's work.
int64_t ItemTokens(const Batch& b, int32_t tile_rows, const PrefillWorkItem& it) {
  const PrefillSeq& s = b.seqs[it.seq];
  const int group = b.geo.num_qo_heads / b.geo.num_kv_heads;
  int end = it.kv_end;
  if (s.causal) {
    const int t_last = std::min(s.q_len - 1, (it.row_begin + tile_rows - 1) / group);
    end = std::min(end, t_last + s.kv_len - s.q_len + s.causal_shift + 1);
  }
  return std::max(end - it.kv_begin, 0);
}

bool SameItem(const PrefillWorkItem& a, const PrefillWorkItem& b) {
  return a.seq == b.seq && a.kv_head == b.kv_head && a.row_begin == b.row_begin && a.kv_begin == b.kv_begin &&
         a.kv_end == b.kv_end && a.part_base == b.part_base;
}

// Persistent kernels: with persistent_ctas = n the plan holds the same items
// as without, CTA c's k-th at k * n + c in the plain plan's order, padding
// (seq -1) only after a CTA's last item, and every CTA's work (the sum of
// PersistentItemCost) within one item of every other's; no more items than
// CTAs, or a layout past max_items, keeps the plain plan.
TEST(PrefillPlan, PersistentCtasDealItemsToTheLeastLoaded) {
  std::mt19937_64 gen(11);
  const KvGeometry geos[] = {Geo(16, 2, 128, 16), Geo(32, 4, 128, 1), Geo(16, 16, 64, 64)};
  int dealt = 0, padded = 0;
  for (const KvGeometry& g : geos) {
    const int32_t M = PrefillTileRows(PrefillKernel::kSm90Overlap, g.head_dim);
    for (int trial = 0; trial < 120; ++trial) {
      Batch b = RandomBatch(gen, g, 1 + trial % 12, trial % 3 != 0);
      for (int32_t ctas : {1, 3, 7, 132}) {
        PrefillPlanOptions opt = ServerOptions(M, 1, int64_t{16} << 20);
        PrefillPlan ref, plan;
        BuildPrefillPlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, opt, &ref);
        opt.persistent_ctas = ctas;
        BuildPrefillPlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, opt, &plan);
        const std::string where = "D " + std::to_string(g.head_dim) + " trial " + std::to_string(trial) +
                                  " ctas " + std::to_string(ctas);
        ASSERT_EQ(CheckPlan(b, opt, plan), "") << where;
        const size_t n = ref.items.size();
        if (n <= static_cast<size_t>(ctas)) {
          ASSERT_EQ(plan.items.size(), n) << where;
          for (size_t i = 0; i < n; ++i) ASSERT_TRUE(SameItem(plan.items[i], ref.items[i])) << where;
          continue;
        }
        ++dealt;
        ASSERT_EQ(plan.items.size() % ctas, 0u) << where;
        const size_t rounds = plan.items.size() / ctas;
        padded += plan.items.size() > n;
        // Walk each CTA's items: the plain plan's items in order, padding last.
        size_t ref_seen = 0;
        std::vector<int64_t> load(ctas, 0);
        int64_t max_cost = 0;
        std::vector<size_t> next_ref(ctas, 0);  // per CTA: index in ref after its last item
        for (int32_t c = 0; c < ctas; ++c) {
          bool padding = false;
          for (size_t k = 0; k < rounds; ++k) {
            const PrefillWorkItem& it = plan.items[k * ctas + c];
            if (it.seq == -1) {
              padding = true;
              continue;
            }
            ASSERT_FALSE(padding) << where << ": an item after padding on CTA " << c;
            // Find it in the plain plan after the CTA's previous item.
            size_t j = next_ref[c];
            while (j < n && !SameItem(ref.items[j], it)) ++j;
            ASSERT_LT(j, n) << where << ": CTA " << c << " runs an item out of the plan's order";
            next_ref[c] = j + 1;
            ++ref_seen;
            const int64_t cost = PersistentItemCost(ItemTokens(b, M, it));
            load[c] += cost;
            max_cost = std::max(max_cost, cost);
          }
        }
        ASSERT_EQ(ref_seen, n) << where;
        const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
        EXPECT_LE(*hi - *lo, max_cost) << where;
        // The same plan with room for fewer entries than the layout needs:
        // the plain order.
        if (plan.items.size() > n) {
          opt.max_items = static_cast<int64_t>(plan.items.size()) - 1;
          PrefillPlan capped;
          BuildPrefillPlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, opt, &capped);
          ASSERT_EQ(capped.items.size(), n) << where;
          for (size_t i = 0; i < n; ++i) ASSERT_TRUE(SameItem(capped.items[i], ref.items[i])) << where;
        }
      }
    }
  }
  EXPECT_GT(dealt, 200);
  EXPECT_GT(padded, 100);
}

TEST(PrefillPlan, PersistentCtasOnlyForTheOverlappedSm90Kernels) {
  EXPECT_EQ(PrefillPersistentCtas(PrefillKernel::kSm90Overlap, 132, 1), 132);
  EXPECT_EQ(PrefillPersistentCtas(PrefillKernel::kSm90OverlapNoPp, 132, 2), 264);
  EXPECT_EQ(PrefillPersistentCtas(PrefillKernel::kSm90, 132, 1), 0);
  EXPECT_EQ(PrefillPersistentCtas(PrefillKernel::kSm80, 132, 1), 0);
  EXPECT_EQ(PrefillPersistentCtas(PrefillKernel::kSm80Rows64, 132, 1), 0);
}

// The checker itself: plans broken the ways a kernel would go wrong are caught.
TEST(PrefillPlan, CheckerCatchesCorruptPlans) {
  std::mt19937_64 gen(10);
  const KvGeometry g = Geo(16, 2, 128, 16);
  int checked = 0;
  for (int trial = 0; trial < 200 && checked < 20; ++trial) {
    Batch b = RandomBatch(gen, g, 4 + trial % 8, true);
    const PrefillPlanOptions opt = ServerOptions(PrefillTileRows(PrefillKernel::kSm80, 128), 2, int64_t{16} << 20);
    PrefillPlan plan;
    BuildPrefillPlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, opt, &plan);
    if (plan.merges.size() < 2) continue;
    ASSERT_EQ(CheckPlan(b, opt, plan), "");
    ++checked;
    int split = -1;
    for (size_t i = 0; i < plan.items.size(); ++i) {
      if (plan.items[i].part_base >= 0) split = static_cast<int>(i);
    }
    ASSERT_GE(split, 0);
    {
      PrefillPlan bad = plan;  // partial region shifted onto a neighbour's
      bad.items[split].part_base += g.num_qo_heads;
      EXPECT_NE(CheckPlan(b, opt, bad), "");
    }
    {
      PrefillPlan bad = plan;  // a lost item
      bad.items.erase(bad.items.begin() + split);
      EXPECT_NE(CheckPlan(b, opt, bad), "");
    }
    {
      PrefillPlan bad = plan;  // merge offsets out of step
      bad.merges[1].pair_begin += 1;
      EXPECT_NE(CheckPlan(b, opt, bad), "");
    }
    {
      PrefillPlan bad = plan;  // a chunk boundary moved
      bad.items[split].kv_end -= 1;
      EXPECT_NE(CheckPlan(b, opt, bad), "");
    }
  }
  EXPECT_EQ(checked, 20);
}

// A window costs the keys it lets through, not the sequence: 2048 rows over
// 128k keys with a 128-key window read about 128 + the tile's rows per tile.
TEST(PrefillPlan, AWindowCostsItsKeysNotTheSequence) {
  const KvGeometry g = Geo(32, 4, 128, 1);
  PrefillSeq s;
  s.q_len = 2048;
  s.kv_len = 131072;
  s.sm_scale = 0.088f;
  s.window_left = 128;
  const std::vector<PrefillSeq> seqs = {s};
  Batch b;
  b.geo = g;
  b.seqs = seqs;
  b.total_q = s.q_len;
  const PrefillPlanOptions opt = ServerOptions(128, 2, int64_t{16} << 20);
  PrefillPlan plan;
  BuildPrefillPlan(seqs.data(), 1, g, opt, &plan);
  ASSERT_EQ(CheckPlan(b, opt, plan), "");
  int64_t keys = 0;
  for (const PrefillWorkItem& it : plan.items) keys += it.kv_end - it.kv_begin;
  // 16 tiles of 16 tokens (8 heads each) per KV head: 16 + 128 keys each.
  EXPECT_EQ(keys, int64_t{4} * (2048 / 16) * (15 + 129));
}

}  // namespace
}  // namespace attnserve
