// N-way merge of attention states on the GPU (MergeStatesParams, see
// kernels/merge_states.h for the math). fp32 math, 16-byte loads and stores
// when head_dim is a multiple of 8; -inf safe (all -inf gives 0 and -inf).
//
// params.v and params.lse are HOST arrays of num_states (at most 16) DEVICE
// pointers; they travel to the kernel by value. v_out / lse_out are device
// pointers. More than 16 states: cudaErrorInvalidValue (merge in rounds).
//
//   const void* v[2] = {d_v0, d_v1};  const float* l[2] = {d_l0, d_l1};
//   MergeStatesParams p;  // p.v = v, p.lse = l, p.num_states = 2, ...
//   MergeStatesCuda(p, stream);
#pragma once

#include <cuda_runtime.h>

#include "kernels/merge_states.h"

namespace attnserve {

cudaError_t MergeStatesCuda(const MergeStatesParams& params, cudaStream_t stream);

}  // namespace attnserve
