// Paged decode attention on tensor cores for batches with few query rows per
// sequence (1..kMaxDecodeQueryRows): one launch runs every work item of a
// DecodePlan (kernels/plan/decode_plan.h), including the merge of split KV
// chunks (the last CTA of a split tile merges; no second launch).
//
// Semantics are those of the prefill family (kernels/paged_prefill.h,
// docs/design.md section 3): mixed layers, scales, masks and LSE bases in one
// batch, GQA, causal with causal_shift, rows that see nothing get 0 and LSE
// -inf, base-2 LSE unless lse_base_e, fp32 accumulation, bf16 / fp16,
// head_dim 64 / 128 / 256, any page_size. FP8 pools (geo.kv_fp8, with
// params.k_scales / v_scales) are read and dequantized in registers.
//
// Usage (all device pointers except the plan):
//   DecodePlanOptions opt;
//   opt.num_sms = <SM count>;
//   opt.ctas_per_sm = DecodeCtasPerSm(geo.head_dim, geo.dtype, tile_rows, geo.kv_fp8);
//   opt.wide_ctas_per_sm = DecodeWideCtasPerSm(geo.head_dim, geo.dtype, tile_rows, geo.kv_fp8);
//   BuildDecodePlan(seqs, num_seqs, geo, opt, &plan);
//   // upload plan.items; part_o / part_lse / counters sized by the plan
//   // (counters zeroed once when allocated: the kernel leaves them zero)
//   PagedDecodeCuda(params, plan.tile_rows, d_items, plan.items.size(),
//                   d_part_o, d_part_lse, d_counters, stream);
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/kv_geometry.h"
#include "kernels/paged_prefill.h"
#include "kernels/plan/decode_plan.h"

namespace attnserve {

// Resident CTAs per SM of the decode kernel for this configuration (for
// DecodePlanOptions::ctas_per_sm). tile_rows as DecodeTileRows returns it.
int32_t DecodeCtasPerSm(int32_t head_dim, KvDType dtype, int32_t tile_rows,
                        Fp8Format kv_fp8 = Fp8Format::kNone);

// Resident CTAs per SM of the family's wide kernel for this configuration,
// which a launch with more items than ctas_per_sm * SMs runs (FP8 pools at
// head_dim 128 with 16-row tiles, where the device holds four of its CTAs an
// SM against three); 0 where there is none. For
// DecodePlanOptions::wide_ctas_per_sm.
int32_t DecodeWideCtasPerSm(int32_t head_dim, KvDType dtype, int32_t tile_rows,
                            Fp8Format kv_fp8 = Fp8Format::kNone);

// Largest thread-block cluster the device co-schedules for this
// configuration (for DecodePlanOptions::max_cluster): up to
// kMaxDecodeCluster on sm_90+, 0 on older GPUs (no cluster mode).
int32_t DecodeMaxCluster(int32_t head_dim, KvDType dtype, int32_t tile_rows,
                         Fp8Format kv_fp8 = Fp8Format::kNone);

// DecodeLaunchOptions::trace: the words each CTA writes.
enum DecodeTraceStamp : int {
  kDecodeTraceStart = 0,     // %globaltimer (ns) as the CTA starts
  kDecodeTraceStreamed = 1,  // thread 0's warp has streamed and used its K/V (the main loop's end)
  kDecodeTraceEnd = 2,       // its rows or partials written (a merging CTA: before the merge)
  kDecodeTraceSm = 3,        // %smid
  kDecodeTraceWords = 4,
};

struct DecodeLaunchOptions {
  // plan.cluster: > 1 runs cluster mode (num_items a multiple of it).
  int32_t cluster = 0;
  // Benchmark only: split tiles leave their partials unmerged (o / lse of
  // split sequences are then not written). No effect in cluster mode.
  bool skip_merge = false;
  // FP8 pools, head_dim 128, 16-row tiles: the kernel compiled for four
  // CTAs an SM instead of three. -1: when the launch has more items than
  // the three-CTA kernel's resident slots and the device holds more CTAs
  // an SM of the four-CTA kernel (DecodeCtasPerSm reports the three-CTA
  // kernel's, DecodeWideCtasPerSm the four-CTA one's: the plan prices
  // both); 0 / 1: never / always (tests and benchmarks). Ignored elsewhere
  // and in cluster mode.
  int32_t four_ctas = -1;
  // Benchmark only: when set, each CTA i writes words
  // [i * kDecodeTraceWords, (i + 1) * kDecodeTraceWords) (DecodeTraceStamp,
  // kernels/decode/traits.cuh): when it started, when its K/V had all
  // streamed in, when it had written its rows, and its SM.
  unsigned long long* trace = nullptr;
};

// Runs every work item (one CTA of 128 threads each). params: q, o, lse,
// pools and kv_indices are device pointers, as for PagedPrefillCuda (the
// kernel reads each sequence from its item's copy, not params.seqs).
// tile_rows: plan.tile_rows. part_o (plan.partial_slots * tile_rows,
// head_dim) and part_lse (plan.partial_slots * tile_rows) are fp32
// workspace; counters (plan.split_tiles) int32, zero on entry and left zero
// on exit. All three may be null when the plan split nothing or ran in
// cluster mode. cudaErrorInvalidValue for a geometry the family does not
// take, and for a pool whose layer holds 2^31 slots or more (num_pages x
// page_size; the kernel's slot arithmetic is 31-bit, and such a pool would
// need 128 GiB a layer at the smallest row).
cudaError_t PagedDecodeCuda(const PagedPrefillParams& params, int32_t tile_rows,
                            const DecodeWorkItem* items, int32_t num_items,
                            float* part_o, float* part_lse, int32_t* counters,
                            cudaStream_t stream, const DecodeLaunchOptions& options = {});

}  // namespace attnserve
