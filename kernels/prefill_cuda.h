// Paged prefill on the GPU: one entry point over every kernel family, chosen
// by the PrefillKernel the plan picked (kernels/plan/kernel_select.h).
//
// Usage (server/backend/cuda/ does exactly this; all device pointers):
//   PrefillKernel k = ChoosePrefillKernel(geo, device, max_packed_rows);
//   PrefillPlanOptions opt;  // tile_rows = PrefillTileRows(k, head_dim),
//                            // ctas_per_sm = PrefillCtasPerSm(k, ...), ...
//   BuildPrefillPlan(seqs, num_seqs, geo, opt, &plan);
//   PagedPrefillCuda(params, d_items, n_items, d_part_o, d_part_lse, k, stream);
//   if (!plan.merges.empty()) MergeSplitsCuda(...);  // kernels/merge/merge_cuda.h
//
// Conventions are those of kernels/paged_prefill.h (docs/design.md section 3).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/kv_geometry.h"
#include "kernels/paged_prefill.h"
#include "kernels/plan/kernel_select.h"
#include "kernels/plan/prefill_plan.h"

namespace attnserve {

// Runs every work item: one CTA each, or for a persistent kernel
// (PrefillPersistentCtas) a grid of at most params.max_ctas CTAs that loop
// over them (the plan pads only their layouts with seq -1 items, which do
// nothing). params' pointers (q, o, lse, pools,
// kv_indices, seqs) are device pointers. part_o (partial_pairs, head_dim) and
// part_lse (partial_pairs) are fp32 workspace, used only by split items.
// cudaErrorInvalidValue for a head_dim the kernel does not support.
cudaError_t PagedPrefillCuda(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse,
                             PrefillKernel kernel, cudaStream_t stream);

// Resident CTAs per SM of the kernel for this head_dim, dtype and pool
// format (kv_fp8), on the current device (the plan's ctas_per_sm).
int32_t PrefillCtasPerSm(PrefillKernel kernel, int32_t head_dim, KvDType dtype,
                         Fp8Format kv_fp8 = Fp8Format::kNone);

}  // namespace attnserve
