// Host plan for the MLA kernel family (kernels/mla/mla_cuda.h): how a batch
// of sequences over a latent cache (docs/design.md section 3, "Multi-head
// latent attention") is cut into work items, one CTA each, and where split
// items keep their partial states. Plain C++ (no CUDA), unit-tested without
// a GPU (tests/kernels/mla_plan_test.cc).
//
// Every query head of MLA reads the same latent rows, so a sequence's
// (query row, head) pairs are its GEMM rows: packed row m of a sequence is
// query row m / num_qo_heads, head m % num_qo_heads, q_len * num_qo_heads of
// them. A tile is tile_rows consecutive packed rows; it reads the keys any
// of its query rows sees (kernels/variant.h's RowsKeys) and nothing else.
// A tile's keys may be cut into chunks (split KV) when the batch has too
// few tiles to fill the device: each chunk writes an fp32 partial state
// (normalized output and base-2 LSE; only chunk 0 carries the sinks) and a
// second launch merges a tile's chunks by LSE into o / lse.
#pragma once

#include <cstdint>
#include <vector>

#include "common/kv_geometry.h"
#include "kernels/paged_prefill.h"

namespace attnserve {

// The latent widths the CUDA family is compiled for (DeepSeek V2/V3, Kimi
// K2, GLM): kv_lora_rank 512, qk_rope_head_dim 64.
inline constexpr int32_t kMlaKvLoraRank = 512;
inline constexpr int32_t kMlaRopeDim = 64;
inline bool MlaCudaSupports(const KvGeometry& g) {
  return g.IsMla() && g.kv_lora_rank == kMlaKvLoraRank && g.qk_rope_head_dim == kMlaRopeDim &&
         !g.KvIsFp8();
}

// One CTA of the MLA kernel.
struct MlaWorkItem {
  int32_t seq = 0;        // index into the batch's seqs
  int32_t row_begin = 0;  // first packed row of the tile
  int32_t kv_begin = 0;   // keys [kv_begin, kv_end) of this chunk
  int32_t kv_end = 0;
  // -1: unsplit (writes o / lse). Otherwise the partial slot of this chunk:
  // part_o[(slot * tile_rows + r) * kv_lora_rank + c], part_lse[slot *
  // tile_rows + r] (base 2), r the packed row within the tile.
  int32_t part_slot = -1;
  int32_t chunk = 0;  // 0 carries the sinks
};

// One split tile for the merge launch: its chunks' slots are consecutive.
struct MlaMergeTile {
  int32_t seq = 0;
  int32_t row_begin = 0;
  int32_t first_slot = 0;
  int32_t num_chunks = 0;
};

struct MlaPlanOptions {
  int32_t tile_rows = 64;        // packed rows per CTA (the kernel's)
  int32_t key_block = 32;        // keys per main-loop step (the kernel's); chunks are multiples
  // A smaller tile (0: none) for batches whose every sequence has at most
  // small_tile_rows packed rows (decode at up to 16 heads), with its key block.
  int32_t small_tile_rows = 0;
  int32_t small_key_block = 0;
  int32_t small_ctas_per_sm = 1;  // the small tile's CTAs an SM (its wave)
  int32_t num_sms = 132;
  int32_t ctas_per_sm = 1;
  int32_t min_chunk_blocks = 4;  // smallest chunk of a split tile, in key blocks
  int32_t max_chunks = 64;       // most chunks of one tile
};

struct MlaPlan {
  int32_t tile_rows = 0;  // the tile shape the plan chose (MlaPlanOptions')
  int32_t key_block = 0;
  std::vector<MlaWorkItem> items;
  std::vector<MlaMergeTile> merges;
  int32_t partial_slots = 0;  // part_o holds partial_slots * tile_rows rows
};

// What a plan of at most max_rows query rows in at most max_rows sequences
// may need, so that a server sizes its staging and workspace once: tiles
// are at most max_rows * num_qo_heads / (the smallest tile the heads can
// take: the small one only at up to small_tile_rows heads) + max_rows (partial
// states are at most MlaMaxTileRows rows a slot); a plan splits
// only when its tiles are fewer than a wave (num_sms * ctas_per_sm) and the
// split shortens the launch (BuildMlaPlan), and then its chunks number at
// most the wave plus its tiles, so its partial slots and merges stay below
// two waves and one wave.
// A plan's wave is num_sms times its tile's CTAs an SM; MlaWave, the bounds'
// wave, takes the larger of the two tiles'.
inline int64_t MlaWave(const MlaPlanOptions& o) {
  const int32_t ctas = o.ctas_per_sm > o.small_ctas_per_sm ? o.ctas_per_sm : o.small_ctas_per_sm;
  return int64_t{o.num_sms > 0 ? o.num_sms : 1} * (ctas > 0 ? ctas : 1);
}
inline int64_t MlaMaxPartialSlots(const MlaPlanOptions& o) { return 2 * MlaWave(o); }
inline int64_t MlaMaxMerges(const MlaPlanOptions& o) { return MlaWave(o); }
inline int32_t MlaMinTileRows(const MlaPlanOptions& o) {
  return o.small_tile_rows > 0 && o.small_tile_rows < o.tile_rows ? o.small_tile_rows : o.tile_rows;
}
inline int32_t MlaMaxTileRows(const MlaPlanOptions& o) {
  return o.small_tile_rows > o.tile_rows ? o.small_tile_rows : o.tile_rows;
}
inline int64_t MlaMaxItems(const MlaPlanOptions& o, int64_t max_rows, int32_t num_qo_heads) {
  // The small tile holds a sequence's rows only at up to small_tile_rows heads.
  const int32_t tile = num_qo_heads <= o.small_tile_rows ? MlaMinTileRows(o) : o.tile_rows;
  return max_rows * num_qo_heads / tile + max_rows + MlaMaxPartialSlots(o);
}

// Plans seqs[0, num_seqs) (validated: kv_len consistent with the indices)
// on geometry geo (an MLA geometry), in the small tile where every
// sequence's packed rows fit it, else in the large one. Tiles whose rows
// see no key still get one item (it writes o = 0 and the LSE: -inf, or the
// sink).
void BuildMlaPlan(const PrefillSeq* seqs, int32_t num_seqs, const KvGeometry& geo,
                  const MlaPlanOptions& options, MlaPlan* plan);

}  // namespace attnserve
