// Host plan for the decode kernel family (kernels/decode/decode_cuda.h):
// which sequences of a batch it runs, how their KV ranges are cut into work
// items (one CTA each) and where split items keep their partial states.
// Plain C++ (no CUDA), unit-tested without a GPU
// (tests/kernels/decode_plan_test.cc).
//
// A work item is (sequence, KV head, packed row tile, KV chunk). Its tile
// packs every query head of the KV head's group and every query row of the
// sequence: packed row r is token r / group, query head
// kv_head * group + r % group, so each K/V byte is read once per group. A
// sequence whose KV range is split into n chunks gives n items per tile that
// write fp32 partial states; the last of them to finish merges the n
// partials (an atomic counter per tile) and writes o / lse. No second launch.
//
// Cluster mode (plan.cluster = C > 1; devices with thread-block clusters,
// sm_90+, when DecodePlanOptions::max_cluster allows it): every tile is cut
// into exactly C chunks of equal length, its C items are consecutive in the
// grid and run as one cluster, and they merge through distributed shared
// memory: no partials in global memory, no counter, no fence. It wins where
// the merge's memory round trips are most of the time: small batches.
//
// Usage (device copies of items; counters zeroed once, at allocation):
//   DecodePlan plan;
//   BuildDecodePlan(seqs, num_seqs, geo, DecodePlanOptions{...}, &plan);
//   PagedDecodeCuda(params, plan.tile_rows, d_items, plan.items.size(),
//                   d_part_o, d_part_lse, d_counters, stream);
#pragma once

#include <cstdint>
#include <vector>

#include "common/kv_geometry.h"
#include "kernels/paged_prefill.h"

namespace attnserve {

// Most query rows per sequence the decode family takes (speculative decode
// up to 8 draft tokens); longer sequences go to the prefill family.
inline constexpr int32_t kMaxDecodeQueryRows = 8;
// Most KV chunks one sequence is split into (bounds the merge's shared
// memory).
inline constexpr int32_t kMaxDecodeChunks = 128;
// Largest cluster of cluster mode (the most CTAs a Hopper cluster holds with
// non-portable sizes).
inline constexpr int32_t kMaxDecodeCluster = 16;
// KV tokens a CTA consumes per round (4 warps x 16); chunks are multiples.
inline constexpr int32_t kDecodeChunkQuantum = 64;

// KV steps (of 16 tokens) a warp of the decode kernel takes a main-loop
// iteration (kernels/decode/traits.cuh): two on FP8 pools at head_dim 128
// with 16-row tiles, except in the wide kernel (decode_cuda.h,
// DecodeWideCtasPerSm), else one. The plan prices such CTAs faster
// (DecodePlanOptions::pair_token_rate).
constexpr int32_t DecodeStepsPerIter(int32_t head_dim, int32_t tile_rows, bool fp8, bool wide) {
  return fp8 && head_dim == 128 && tile_rows == 16 && !wide ? 2 : 1;
}

// One CTA of the decode kernel.
struct DecodeWorkItem {
  int32_t seq = 0;        // index into the batch's seqs
  int32_t kv_head = 0;
  int32_t row_begin = 0;  // first packed row of the tile within the sequence
  int32_t kv_begin = 0;   // KV positions [kv_begin, kv_end) of this chunk
  int32_t kv_end = 0;
  // -1: unsplit, the item writes o / lse itself. Otherwise the tile's
  // counter: counters[split_tile] counts finished chunks of the tile.
  int32_t split_tile = -1;
  int32_t chunk = 0;       // chunk index within the tile's chunks
  int32_t num_chunks = 1;  // chunks of this tile
  // Partial tile slot of chunk 0; chunk c uses slot part_begin + c:
  // part_o[((slot * tile_rows) + r) * head_dim + d] and
  // part_lse[slot * tile_rows + r] (base-2), r the packed row in the tile.
  int32_t part_begin = 0;
  // A copy of seqs[seq]: the kernel reads its sequence from the item it
  // already loads, not by a second dependent load (which costs a memory
  // round trip before the first K/V request of every CTA).
  PrefillSeq seq_info;
};

struct DecodePlanOptions {
  int32_t num_sms = 132;
  // Resident CTAs per SM of the kernel (DecodeCtasPerSm on the device).
  int32_t ctas_per_sm = 2;
  // Resident CTAs per SM of the family's wide kernel, which the launch runs
  // for more items than num_sms * ctas_per_sm (DecodeWideCtasPerSm on the
  // device; 0: none). A candidate with more items is priced with
  // num_sms * wide_ctas_per_sm slots (FP8 128 x 4096 on an H200: 512 items
  // in one wave of four CTAs an SM, 0.137 ms, against 1,536 split items on
  // three, 0.160; bench/results/2026-12-04-session26-h200.md).
  int32_t wide_ctas_per_sm = 0;
  // Smallest KV chunk (tokens) of a split item; rounded up to
  // kDecodeChunkQuantum.
  int32_t min_chunk = 128;
  // Cost model of a candidate plan, in ns (see BuildDecodePlan), fitted to
  // the H200 run of issue #14 (bench/NOTES.md, "v1"):
  //   x      = items * cta_bytes_per_ns / hbm_bytes_per_ns
  //   rate   = hbm_bytes_per_ns * x / (1 + x^4)^(1/4)   (aggregate, B/ns)
  //   share  = min(cta_bytes_per_ns, hbm_bytes_per_ns / min(items, slots))
  //   waves  = ceil(items / slots)      (slots = num_sms * ctas_per_sm, or
  //                                      num_sms * wide_ctas_per_sm past it)
  //   stream = max(all items' K/V bytes / rate,
  //                waves * (longest item's bytes / share + wave_start_ns))
  //   cost   = stream + (split: merge_ns + merge_ns_per_chunk * max chunks
  //                      + partial bytes written and read / hbm_bytes_per_ns)
  // hbm_bytes_per_ns: the marginal rate of decode 64 -> 128 -> 256 x 4096
  // (4.29 and 4.33 TB/s, the copy ceiling). cta_bytes_per_ns: what one CTA
  // streams, fitted to the second H200 run's chunk sweep of 8 x 128k: 128
  // CTAs 3.73 TB/s, 256 CTAs 4.33 TB/s (the first estimate, 64 B/ns, chose
  // 128 CTAs and lost 14%); the aggregate saturates smoothly once
  // items * cta_bytes_per_ns passes the HBM rate. The rest of
  // the 64 x 4096 time (about 10 us over bytes / 4.3 TB/s, and 6 us for
  // 8 x 128k, with the same 256 CTAs) is a fixed launch / ramp / tail cost
  // that no split removes, so such batches stay unsplit. merge_*: the last
  // CTA's merge (fence, atomic, one pass over the LSEs, then 8 KiB of
  // partials per chunk and 16-row tile); merge_ns_per_chunk = 150 puts the
  // 1 x 4096 plan at the best of the second run's chunk sweep (16 chunks of
  // 256 per tile: 0.0203 ms; 8 chunks 0.0226, 32 chunks 0.0208). An FP8
  // pool's CTA is taken to stream half these bytes (the same tokens): one
  // CTA alone on an SM streams about 18.5 B/ns of FP8 on the H200 (8 x 128k
  // in 128 chunks, bench/results/2026-12-03-session16-h200.md). The waves
  // term: items beyond the resident slots wait for one, and a launch of
  // more items than slots pays a whole wave for its last, partly filled one
  // (FP8 8 x 128k on 396 slots: 256 items 0.299 ms, 512 items 0.345 ms,
  // 1024 items 0.311 ms; 64 x 4096: 256 items 0.085 ms, 512 0.105, 768
  // 0.090); wave_start_ns is each wave's start and end (the page table and
  // the first K/V, the epilogue), which makes more, shorter items dearer:
  // fitted to the same sweeps (4.7-12 us a wave for split FP8 plans).
  double hbm_bytes_per_ns = 4300;
  double cta_bytes_per_ns = 36;
  double wave_start_ns = 6000;
  double merge_ns = 1000;
  double merge_ns_per_chunk = 150;
  // FP8 pools, on a kernel whose warps take two steps an iteration
  // (DecodeStepsPerIter: head_dim 128, 16-row tiles, not the wide kernel):
  // its CTA's tokens per ns against a 16-bit CTA's. H200,
  // bench/results/2026-12-04-session26-h200.md: FP8 8 x 128k in 32 and 128
  // unsplit items streams 25.5 and 24.4 B/ns a CTA (0.5 x 36 before the
  // pairs, 18.5 measured).
  double pair_token_rate = 1.4;
  // Largest cluster the device runs for the decode kernel (0 or 1: no
  // cluster mode; DecodeMaxCluster() on the device).
  int32_t max_cluster = 0;
  // The merge of cluster mode: two cluster barriers and one pass over C
  // states in distributed shared memory.
  double cluster_merge_ns = 600;
  // Most work items the caller's workspace takes (0: no bound); cluster
  // plans beyond it are not considered.
  int64_t max_items = 0;
  // Forces every sequence longer than min_chunk into chunks of this many
  // tokens (0: the heuristic). For tests and A/B benchmarks.
  int32_t force_chunk = 0;
  // Forces cluster mode with this many chunks per tile (2..max_cluster; 0:
  // the heuristic). For tests and A/B benchmarks; force_chunk wins.
  int32_t force_cluster = 0;
  // Never split (for A/B benchmarks).
  bool no_split = false;
  // Most partial tile slots the caller's workspace holds (0: no bound). A
  // chunking that needs more is not considered (forced chunks fall back to
  // longer ones, then to no split).
  int64_t max_partial_slots = 0;
};

struct DecodePlan {
  std::vector<DecodeWorkItem> items;  // longest chunk first
  int32_t tile_rows = 16;     // packed rows per tile (16 or 32)
  int32_t chunk_len = 0;      // KV tokens per split chunk; 0 if none split
                              // (cluster mode: the longest tile's chunk)
  int32_t cluster = 0;        // > 1: cluster mode, this many CTAs per tile
  int32_t split_tiles = 0;    // counters the kernel uses (int32 each)
  int64_t partial_slots = 0;  // partial tile slots (tile_rows rows each)
  int32_t num_seqs_planned = 0;
  // Workspace the kernel needs, in bytes: part_o, part_lse, counters.
  int64_t PartOBytes(int32_t head_dim) const {
    return partial_slots * tile_rows * head_dim * 4;
  }
  int64_t PartLseBytes() const { return partial_slots * tile_rows * 4; }
  int64_t CounterBytes() const { return int64_t{split_tiles} * 4; }
};

// Whether the decode family supports this geometry (head_dim 64, 128 or
// 256; num_qo_heads a multiple of num_kv_heads).
bool DecodeGeometrySupported(const KvGeometry& geo);

// Whether the decode family runs this sequence: 1..kMaxDecodeQueryRows query
// rows on a supported geometry. Sequences with q_len 0 qualify for neither
// family (they produce no rows).
bool DecodeSeqQualifies(const PrefillSeq& seq, const KvGeometry& geo);

// Whether the whole batch can run through the decode family alone: every
// sequence with rows qualifies.
bool DecodeBatchQualifies(const PrefillSeq* seqs, int32_t num_seqs,
                          const KvGeometry& geo);

// For a mixed batch (a few prefill chunks + many decode rows): copies seqs
// into *prefill_seqs with q_len set to 0 for every sequence the decode family
// takes, so that BuildPrefillPlan on the copy plans exactly the others (its
// items index the same device seqs array; only the host plan reads the copy).
// Returns the number of sequences left to the decode family.
int32_t SeqsForPrefillFamily(const PrefillSeq* seqs, int32_t num_seqs, const KvGeometry& geo,
                             std::vector<PrefillSeq>* prefill_seqs);

// Packed rows per tile for the decode kernel: 16 or 32, the smaller that
// holds max_rows (q_len * group of the largest sequence); 16 for head_dim 256
// so the fp32 output accumulators stay in registers (no spills). Sequences
// with more packed rows get several tiles (each reads the group's K/V).
int32_t DecodeTileRows(int32_t head_dim, int32_t max_rows);

// Plans the qualifying sequences of the batch (DecodeSeqQualifies); the rest
// are left to the prefill family. Never fails for validated input (page ids
// in range, kv_len consistent with the indices).
void BuildDecodePlan(const PrefillSeq* seqs, int32_t num_seqs,
                     const KvGeometry& geo, const DecodePlanOptions& options,
                     DecodePlan* plan);

}  // namespace attnserve
