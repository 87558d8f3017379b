#include "kernels/plan/mla_plan.h"

#include <algorithm>

#include "kernels/variant.h"

namespace attnserve {
namespace {

struct Tile {
  int32_t seq;
  int32_t row_begin;
  KeyRange keys;
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void BuildMlaPlan(const PrefillSeq* seqs, int32_t num_seqs, const KvGeometry& geo,
                  const MlaPlanOptions& options, MlaPlan* plan) {
  plan->items.clear();
  plan->merges.clear();
  plan->partial_slots = 0;
  const int32_t heads = geo.num_qo_heads;
  int64_t max_seq_rows = 0;
  for (int32_t s = 0; s < num_seqs; ++s) {
    max_seq_rows = std::max<int64_t>(max_seq_rows, int64_t{seqs[s].q_len} * heads);
  }
  const bool small = options.small_tile_rows > 0 && max_seq_rows <= options.small_tile_rows;
  plan->tile_rows = small ? options.small_tile_rows : options.tile_rows;
  plan->key_block = small ? options.small_key_block : options.key_block;
  const int32_t tile_rows = plan->tile_rows;
  const int32_t block = std::max(1, plan->key_block);
  std::vector<Tile> tiles;
  int64_t total_blocks = 0;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const PrefillSeq& seq = seqs[s];
    if (seq.q_len <= 0) continue;
    const int64_t rows = int64_t{seq.q_len} * heads;
    for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
      const int64_t r1 = std::min(rows, r0 + tile_rows) - 1;
      const KeyRange keys =
          RowsKeys(seq, static_cast<int32_t>(r0 / heads), static_cast<int32_t>(r1 / heads)).read;
      tiles.push_back(Tile{s, static_cast<int32_t>(r0), keys});
      total_blocks += CeilDiv(keys.size(), block);
    }
  }
  // Split only when the tiles alone leave CTAs of one wave idle: chunks of
  // about total_blocks / wave blocks, at least min_chunk_blocks; and only
  // when that shortens the launch: its waves of chunks times the longest
  // chunk must come under nine tenths of the longest tile (the tenth pays
  // for the partial states' writes and the merge). 128 tiles of 64 blocks on
  // 132 SMs stay whole: two waves of 32-block halves take as long, and the
  // merge on top.
  const int32_t ctas = std::max(1, small ? options.small_ctas_per_sm : options.ctas_per_sm);
  const int64_t wave = int64_t{std::max(1, options.num_sms)} * ctas;
  bool split = static_cast<int64_t>(tiles.size()) < wave && total_blocks > 0;
  const int64_t chunk_blocks =
      split ? std::max<int64_t>(options.min_chunk_blocks, CeilDiv(total_blocks, wave)) : 0;
  // A tile of `keys` keys: its chunks' key count (the last takes the rest;
  // one chunk: the whole tile's blocks) and number.
  auto chunking = [&](int64_t keys, int64_t* per_keys, int64_t* chunks) {
    const int64_t blocks = CeilDiv(keys, block);
    const int64_t wanted = std::clamp<int64_t>(split ? CeilDiv(blocks, chunk_blocks) : 1, 1,
                                               std::max(1, options.max_chunks));
    *per_keys = CeilDiv(blocks, wanted) * block;
    *chunks = wanted == 1 ? 1 : CeilDiv(keys, *per_keys);
  };
  if (split) {
    int64_t longest = 0, longest_chunk = 0, items = 0;
    for (const Tile& t : tiles) {
      int64_t per = 0, chunks = 0;
      chunking(t.keys.size(), &per, &chunks);
      longest = std::max(longest, CeilDiv(t.keys.size(), block));
      longest_chunk = std::max(longest_chunk, per / block);
      items += chunks;
    }
    split = 10 * CeilDiv(items, wave) * longest_chunk < 9 * longest;
  }
  for (const Tile& t : tiles) {
    int64_t per = 0, chunks = 1;
    if (split) chunking(t.keys.size(), &per, &chunks);
    if (chunks == 1) {
      MlaWorkItem item;
      item.seq = t.seq;
      item.row_begin = t.row_begin;
      item.kv_begin = t.keys.begin;
      item.kv_end = t.keys.end;  // RowsKeys' read range: end >= begin
      plan->items.push_back(item);
      continue;
    }
    // Chunks of whole key blocks (the last takes the rest).
    MlaMergeTile merge;
    merge.seq = t.seq;
    merge.row_begin = t.row_begin;
    merge.first_slot = plan->partial_slots;
    merge.num_chunks = static_cast<int32_t>(chunks);
    for (int64_t c = 0; c < chunks; ++c) {
      MlaWorkItem item;
      item.seq = t.seq;
      item.row_begin = t.row_begin;
      item.kv_begin = static_cast<int32_t>(t.keys.begin + c * per);
      item.kv_end = static_cast<int32_t>(std::min<int64_t>(t.keys.end, t.keys.begin + (c + 1) * per));
      item.part_slot = plan->partial_slots++;
      item.chunk = static_cast<int32_t>(c);
      plan->items.push_back(item);
    }
    plan->merges.push_back(merge);
  }
}

}  // namespace attnserve
