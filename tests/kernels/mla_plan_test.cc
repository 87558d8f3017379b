// The MLA family's host plan (kernels/plan/mla_plan.h): every visible
// (packed row, key) pair of every sequence falls in exactly one work item of
// the row's tile, no item reads a key outside its tile's rows' reach, chunks
// split only when the tiles leave a wave idle and the split shortens the
// launch, and the merges name each split tile's consecutive partial slots.
#include "kernels/plan/mla_plan.h"

#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/variant.h"

namespace attnserve {
namespace {

KvGeometry MlaGeo(int32_t heads, int32_t page_size) {
  KvGeometry g;
  g.num_layers = 1;
  g.num_pages = 4096;
  g.page_size = page_size;
  g.num_qo_heads = heads;
  g.num_kv_heads = 1;
  g.attention = AttentionKind::kMla;
  g.kv_lora_rank = kMlaKvLoraRank;
  g.qk_rope_head_dim = kMlaRopeDim;
  g.head_dim = kMlaKvLoraRank + kMlaRopeDim;
  return g;
}

std::vector<PrefillSeq> RandomSeqs(std::mt19937_64& gen, int n, int max_q, int max_kv) {
  std::vector<PrefillSeq> seqs;
  int32_t q_start = 0;
  for (int i = 0; i < n; ++i) {
    PrefillSeq s;
    s.q_start = q_start;
    s.q_len = static_cast<int32_t>(gen() % (max_q + 1));
    s.kv_len = static_cast<int32_t>(gen() % (max_kv + 1));
    s.causal = gen() % 4 != 0;
    s.window_left = gen() % 3 == 0 ? static_cast<int32_t>(gen() % 200) : -1;
    s.causal_shift = gen() % 5 == 0 ? static_cast<int32_t>(gen() % 50) : 0;
    q_start += s.q_len;
    seqs.push_back(s);
  }
  return seqs;
}

// n decode sequences (one row each) of kv_len keys.
std::vector<PrefillSeq> DecodeSeqs(int n, int32_t kv_len) {
  std::vector<PrefillSeq> seqs(n);
  for (int i = 0; i < n; ++i) {
    seqs[i].q_start = i;
    seqs[i].q_len = 1;
    seqs[i].kv_len = kv_len;
  }
  return seqs;
}

void CheckPlan(const std::vector<PrefillSeq>& seqs, const KvGeometry& g, const MlaPlan& plan,
               const MlaPlanOptions& opt) {
  const int32_t heads = g.num_qo_heads;
  // Within the bounds a server sizes its staging and workspace by.
  int64_t rows = 0;
  for (const PrefillSeq& s : seqs) rows += s.q_len;
  rows = std::max<int64_t>({rows, static_cast<int64_t>(seqs.size()), 1});
  EXPECT_LE(static_cast<int64_t>(plan.items.size()), MlaMaxItems(opt, rows, heads));
  EXPECT_LE(plan.partial_slots, MlaMaxPartialSlots(opt));
  EXPECT_LE(static_cast<int64_t>(plan.merges.size()), MlaMaxMerges(opt));
  // (seq, row_begin) -> covered key counts per packed row and key.
  std::map<std::tuple<int32_t, int32_t>, std::vector<const MlaWorkItem*>> by_tile;
  for (const MlaWorkItem& item : plan.items) {
    by_tile[{item.seq, item.row_begin}].push_back(&item);
    EXPECT_LE(item.kv_begin, item.kv_end);
  }
  int64_t tiles = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const PrefillSeq& seq = seqs[s];
    const int32_t rows = seq.q_len * heads;
    for (int32_t r0 = 0; r0 < rows; r0 += plan.tile_rows) {
      ++tiles;
      auto it = by_tile.find({static_cast<int32_t>(s), r0});
      ASSERT_NE(it, by_tile.end()) << "sequence " << s << " tile " << r0 << " has no item";
      const std::vector<const MlaWorkItem*>& items = it->second;
      // Each row's visible keys are covered exactly once.
      for (int32_t r = r0; r < std::min(rows, r0 + plan.tile_rows); ++r) {
        const KeyRange want = RowKeys(seq, r / heads);
        for (int32_t j = 0; j < seq.kv_len; ++j) {
          int covered = 0;
          for (const MlaWorkItem* item : items) covered += j >= item->kv_begin && j < item->kv_end;
          const bool visible = j >= want.begin && j < want.end;
          if (visible) {
            ASSERT_EQ(covered, 1) << "seq " << s << " row " << r << " key " << j;
          } else {
            ASSERT_LE(covered, 1);
          }
        }
      }
      // Split tiles: chunks in order, slots consecutive, one merge entry.
      if (items.size() > 1) {
        for (size_t c = 0; c < items.size(); ++c) {
          EXPECT_EQ(items[c]->chunk, static_cast<int32_t>(c));
          EXPECT_EQ(items[c]->part_slot, items[0]->part_slot + static_cast<int32_t>(c));
          if (c > 0) {
            EXPECT_EQ(items[c]->kv_begin, items[c - 1]->kv_end);
          }
        }
        int found = 0;
        for (const MlaMergeTile& m : plan.merges) {
          if (m.seq == static_cast<int32_t>(s) && m.row_begin == r0) {
            ++found;
            EXPECT_EQ(m.first_slot, items[0]->part_slot);
            EXPECT_EQ(m.num_chunks, static_cast<int32_t>(items.size()));
          }
        }
        EXPECT_EQ(found, 1);
      } else {
        EXPECT_EQ(items[0]->part_slot, -1);
      }
    }
  }
  EXPECT_EQ(static_cast<int64_t>(by_tile.size()), tiles);
}

TEST(MlaPlanTest, CoversEveryVisiblePairOnceWithAndWithoutSplits) {
  std::mt19937_64 gen(5);
  for (int heads : {16, 128}) {
    for (int32_t page_size : {1, 64}) {
      for (int round = 0; round < 6; ++round) {
        const KvGeometry g = MlaGeo(heads, page_size);
        const auto seqs = RandomSeqs(gen, 1 + round * 3, round % 2 == 0 ? 8 : 40, 700);
        // The device shapes (kernels/mla/mla.cu): 64 x 32 with a 16 x 64
        // small tile, 16 x 32 alone, and 64 x 32 alone.
        for (int shape = 0; shape < 3; ++shape) {
          MlaPlanOptions opt;
          opt.tile_rows = shape == 1 ? 16 : 64;
          opt.key_block = 32;
          opt.small_tile_rows = shape == 0 ? 16 : 0;
          opt.small_key_block = shape == 0 ? 64 : 0;
          opt.num_sms = round % 3 == 0 ? 132 : 4;
          MlaPlan plan;
          BuildMlaPlan(seqs.data(), static_cast<int32_t>(seqs.size()), g, opt, &plan);
          CheckPlan(seqs, g, plan, opt);
        }
      }
    }
  }
}

TEST(MlaPlanTest, SplitsOnlyWhenTheTilesLeaveTheWaveIdle) {
  const KvGeometry g = MlaGeo(16, 64);
  // 2 decode sequences of 4096 keys: 2 tiles on 132 SMs, so they split.
  std::vector<PrefillSeq> seqs = DecodeSeqs(2, 4096);
  MlaPlanOptions opt;
  MlaPlan plan;
  BuildMlaPlan(seqs.data(), 2, g, opt, &plan);
  EXPECT_GT(plan.items.size(), 2u);
  EXPECT_EQ(plan.merges.size(), 2u);
  EXPECT_EQ(plan.partial_slots, static_cast<int32_t>(plan.items.size()));
  CheckPlan(seqs, g, plan, opt);
  // 200 decode sequences: 200 tiles fill 132 SMs, nothing splits.
  seqs = DecodeSeqs(200, 4096);
  BuildMlaPlan(seqs.data(), 200, g, opt, &plan);
  EXPECT_EQ(plan.items.size(), 200u);
  EXPECT_TRUE(plan.merges.empty());
  EXPECT_EQ(plan.partial_slots, 0);
  // 128 heads, 2 rows: 4 tiles per sequence.
  const KvGeometry g128 = MlaGeo(128, 64);
  seqs.resize(1);
  seqs[0].q_len = 2;
  BuildMlaPlan(seqs.data(), 1, g128, opt, &plan);
  CheckPlan(seqs, g128, plan, opt);
  EXPECT_EQ(plan.merges.size(), 4u);
}

TEST(MlaPlanTest, SplitsOnlyWhenThatShortensTheLaunch) {
  // Decode at 128 heads, 64 sequences of 4096 keys in 64 x 64 tiles: 128
  // tiles on 132 SMs. Halves would take two waves of 32 blocks, as long as
  // one wave of whole tiles, and the merge on top: no split.
  const KvGeometry g128 = MlaGeo(128, 64);
  MlaPlanOptions opt;
  opt.key_block = 64;
  std::vector<PrefillSeq> seqs = DecodeSeqs(64, 4096);
  MlaPlan plan;
  BuildMlaPlan(seqs.data(), 64, g128, opt, &plan);
  EXPECT_EQ(plan.items.size(), 128u);
  EXPECT_TRUE(plan.merges.empty());
  CheckPlan(seqs, g128, plan, opt);
  // 32 sequences (64 tiles): halves fit one wave, so they split.
  seqs.resize(32);
  BuildMlaPlan(seqs.data(), 32, g128, opt, &plan);
  EXPECT_EQ(plan.items.size(), 128u);
  EXPECT_EQ(plan.merges.size(), 64u);
  CheckPlan(seqs, g128, plan, opt);
  // Ragged: one long sequence among short ones splits, although the short
  // ones' tiles alone would take most of the wave.
  seqs = DecodeSeqs(60, 256);
  seqs.push_back(DecodeSeqs(1, 16384)[0]);
  seqs.back().q_start = 60;
  BuildMlaPlan(seqs.data(), 61, g128, opt, &plan);
  EXPECT_FALSE(plan.merges.empty());
  CheckPlan(seqs, g128, plan, opt);
}

TEST(MlaPlanTest, TakesTheSmallTileWhenEverySequenceFitsIt) {
  MlaPlanOptions opt;
  opt.small_tile_rows = 16;
  opt.small_key_block = 64;
  std::vector<PrefillSeq> seqs = DecodeSeqs(3, 300);
  MlaPlan plan;
  // 16 heads, one row each: 16 packed rows a sequence.
  const KvGeometry g16 = MlaGeo(16, 16);
  BuildMlaPlan(seqs.data(), 3, g16, opt, &plan);
  EXPECT_EQ(plan.tile_rows, 16);
  EXPECT_EQ(plan.key_block, 64);
  CheckPlan(seqs, g16, plan, opt);
  // One sequence of 2 rows (32 packed rows): the whole batch takes 64 x 32.
  seqs[2].q_len = 2;
  BuildMlaPlan(seqs.data(), 3, g16, opt, &plan);
  EXPECT_EQ(plan.tile_rows, 64);
  EXPECT_EQ(plan.key_block, 32);
  CheckPlan(seqs, g16, plan, opt);
  // 8 heads, 2 rows: still 16 packed rows.
  const KvGeometry g8 = MlaGeo(8, 16);
  BuildMlaPlan(seqs.data(), 3, g8, opt, &plan);
  EXPECT_EQ(plan.tile_rows, 16);
  CheckPlan(seqs, g8, plan, opt);
  // The small tile's wave is num_sms x small_ctas_per_sm: its 3 tiles of 5
  // blocks split on a wave of 6 (6 SMs at one CTA, 3 at two: two chunks of
  // 3 blocks each, one wave), not on one of 2.
  opt.num_sms = 2;
  opt.small_ctas_per_sm = 1;
  BuildMlaPlan(seqs.data(), 3, g8, opt, &plan);
  EXPECT_TRUE(plan.merges.empty());
  opt.num_sms = 6;
  BuildMlaPlan(seqs.data(), 3, g8, opt, &plan);
  EXPECT_FALSE(plan.merges.empty());
  opt.small_ctas_per_sm = 2;
  opt.num_sms = 1;
  BuildMlaPlan(seqs.data(), 3, g8, opt, &plan);
  EXPECT_TRUE(plan.merges.empty());
  opt.num_sms = 3;
  BuildMlaPlan(seqs.data(), 3, g8, opt, &plan);
  EXPECT_FALSE(plan.merges.empty());
  CheckPlan(seqs, g8, plan, opt);
  // Without a small tile, the large one.
  opt.small_tile_rows = 0;
  BuildMlaPlan(seqs.data(), 3, g8, opt, &plan);
  EXPECT_EQ(plan.tile_rows, 64);
  CheckPlan(seqs, g8, plan, opt);
}

TEST(MlaPlanTest, StaysWithinTheBoundsTheServerSizesItsWorkspaceBy) {
  // Few long sequences on many SMs split most; many short ones on few SMs
  // not at all; CheckPlan asserts the bounds either way.
  std::mt19937_64 gen(17);
  for (int round = 0; round < 40; ++round) {
    const KvGeometry g = MlaGeo(round % 2 == 0 ? 16 : 128, round % 3 == 0 ? 1 : 64);
    const auto seqs = RandomSeqs(gen, 1 + static_cast<int>(gen() % 30), 1 + round % 9, 9000);
    MlaPlanOptions opt;
    opt.num_sms = 1 + static_cast<int32_t>(gen() % 140);
    opt.ctas_per_sm = 1 + round % 2;
    opt.min_chunk_blocks = 1 + round % 4;
    if (round % 4 < 2) {  // the H200's small tile: 16 x 32, two CTAs an SM
      opt.small_tile_rows = 16;
      opt.small_key_block = 32;
      opt.small_ctas_per_sm = 2 + round % 2;
    }
    MlaPlan plan;
    BuildMlaPlan(seqs.data(), static_cast<int32_t>(seqs.size()), g, opt, &plan);
    CheckPlan(seqs, g, plan, opt);
  }
}

TEST(MlaPlanTest, SequencesWithoutRowsOrKeys) {
  const KvGeometry g = MlaGeo(16, 16);
  std::vector<PrefillSeq> seqs(3);
  seqs[0].q_len = 0;
  seqs[0].kv_len = 100;
  seqs[1].q_len = 3;  // no keys: one item per tile, nothing to read
  seqs[1].kv_len = 0;
  seqs[2].q_start = 3;
  seqs[2].q_len = 5;  // causal rows before the keys see nothing
  seqs[2].kv_len = 2;
  MlaPlan plan;
  const MlaPlanOptions opt;
  BuildMlaPlan(seqs.data(), 3, g, opt, &plan);
  CheckPlan(seqs, g, plan, opt);
  for (const MlaWorkItem& item : plan.items) EXPECT_NE(item.seq, 0);
}

}  // namespace
}  // namespace attnserve
