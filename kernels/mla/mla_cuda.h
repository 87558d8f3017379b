// The MLA kernel family (docs/design.md section 3, "Multi-head latent
// attention"): paged attention of absorbed MLA queries (kv_lora_rank +
// qk_rope_head_dim = 576 wide) over one pool of latent rows whose first
// kv_lora_rank (512) values are the values, for decode (1..8 query rows) and
// prefill alike. Semantics are the prefill family's (kernels/paged_prefill.h,
// kernels/variant.h): ragged batches mixing layers, scales, masks, windows,
// soft-caps, sinks and LSE bases; rows that see nothing get 0 and LSE -inf
// (or the sink); fp32 accumulation; bf16 or fp16.
//
// Design (v2, mma.sync, sm_80 and up): a CTA of 8 warps takes a tile of
// tile_rows packed (query row, head) pairs of one sequence (kernels/plan/
// mla_plan.h) and one KV chunk; Q's tile stays in shared memory, K blocks of
// key_block latent rows stream through two cp.async stages, each read once
// for every head of the tile. Each warp owns 16 rows and a slice of the 512
// output columns. S = Q K^T is computed once: the warps of a row group
// split the block's keys into pieces, put their pieces' row maxima in shared
// memory, take the block's maxima from there (so every warp of a row group
// keeps the same running maximum), and write P (16-bit) to shared memory;
// then each warp runs O += P V on its columns, V being the first 512
// columns of the same K block. Shapes (rows x key block): 64 x 32; for
// decode at up to 16 heads (the plan's small tile) 16 x 32 at two CTAs an
// SM where two fit (H100, H200), else 16 x 64 where a block takes 165 KiB,
// else 16 x 32 at one; 16 x 32 alone where a block cannot take 150 KiB.
// On sm_90 (H100, H200) the large tile is instead 64 x 64 in the wgmma
// kernel (kernels/mla/mla_sm90.h): one warpgroup computes S (Q's first 384
// columns held in its registers) and the softmax, two hold O's halves, run
// P V beside the next block's S and load the key blocks.
// Split chunks write fp32 partial states that MergeMlaCuda combines by LSE.
//
// Usage (device pointers except the plan):
//   MlaPlanOptions opt = MlaPlanOptionsForDevice();  // tile shape, SMs
//   MlaPlan plan;
//   BuildMlaPlan(host_seqs, num_seqs, geo, opt, &plan);
//   // upload plan.items and plan.merges; part_o (plan.partial_slots *
//   // plan.tile_rows, 512) and part_lse (plan.partial_slots * tile_rows) fp32
//   PagedMlaCuda(params, plan.tile_rows, plan.key_block, d_items, plan.items.size(), d_part_o, d_part_lse, s);
//   MergeMlaCuda(params, plan.tile_rows, d_merges, plan.merges.size(), d_part_o, d_part_lse, s);
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/paged_prefill.h"
#include "kernels/plan/mla_plan.h"

namespace attnserve {

// The plan options of the current device: the tile shapes its shared memory
// and architecture allow (above; on the H100 and H200 64 x 64 with the small
// tile 16 x 32 at two CTAs an SM) and its SM count.
MlaPlanOptions MlaPlanOptionsForDevice();

// Shared memory a block of the tile_rows x key_block shape takes, in bytes
// (-1: not a shape above).
int MlaTileSmemBytes(int32_t tile_rows, int32_t key_block);

// Whether the current device runs the tile_rows x key_block shape (its
// shared memory; 64 x 64 also needs sm_90).
bool MlaTileRuns(int32_t tile_rows, int32_t key_block);

// Runs every work item of a plan of tile_rows x key_block (one of the
// shapes above that the device runs, else cudaErrorInvalidValue). params: q, o, lse, k_cache,
// kv_indices, seqs (the batch's PrefillSeq array) and sinks are device
// pointers; params.geo must satisfy MlaCudaSupports (else
// cudaErrorInvalidValue). part_o / part_lse may be null when no item is split.
cudaError_t PagedMlaCuda(const PagedPrefillParams& params, int32_t tile_rows, int32_t key_block,
                         const MlaWorkItem* items, int32_t num_items, float* part_o,
                         float* part_lse, cudaStream_t stream);

// Merges the split tiles' partial states into params.o / params.lse.
cudaError_t MergeMlaCuda(const PagedPrefillParams& params, int32_t tile_rows,
                         const MlaMergeTile* merges, int32_t num_merges, const float* part_o,
                         const float* part_lse, cudaStream_t stream);

}  // namespace attnserve
