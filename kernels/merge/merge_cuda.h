// The N-way merge family on the GPU (the math: kernels/merge_states.h).
// fp32 math, 16-byte loads and stores when head_dim is a multiple of 8, -inf
// safe (all -inf gives 0 and -inf). One kernel template serves both entry
// points; they differ only in where a row's states live.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/merge_states.h"
#include "kernels/paged_prefill.h"
#include "kernels/plan/prefill_plan.h"

namespace attnserve {

// MergeStates: params.v and params.lse are HOST arrays of num_states (at
// most 16) DEVICE pointers; they travel to the kernel by value. v_out /
// lse_out are device pointers. More than 16 states: cudaErrorInvalidValue
// (merge in rounds).
//
//   const void* v[2] = {d_v0, d_v1};  const float* l[2] = {d_l0, d_l1};
//   MergeStatesParams p;  // p.v = v, p.lse = l, p.num_states = 2, ...
//   MergeStatesCuda(p, stream);
cudaError_t MergeStatesCuda(const MergeStatesParams& params, cudaStream_t stream);

// The split-KV pass: merges the split sequences' fp32 partial states (the
// plan's workspace, base-2 LSEs) into params.o / params.lse. merges is a
// device array of num_merges; merge_pairs is PrefillPlan::merge_pairs.
cudaError_t MergeSplitsCuda(const PagedPrefillParams& params, const SplitMergeSeq* merges,
                            int32_t num_merges, int32_t merge_pairs, const float* part_o,
                            const float* part_lse, cudaStream_t stream);

}  // namespace attnserve
