// N-way merge of attention states on the GPU (MergeStatesParams, see
// kernels/merge_states.h for the math). fp32 math, 16-byte loads and stores
// when head_dim is a multiple of 8; -inf safe (all -inf gives 0 and -inf).
//
// Unlike the CPU reference, params.v and params.lse point to DEVICE arrays of
// num_states device pointers, and v_out / lse_out are device pointers.
//
//   MergeStatesParams p;  // p.v = d_v_ptrs, p.lse = d_lse_ptrs, ...
//   MergeStatesCuda(p, stream);
#pragma once

#include <cuda_runtime.h>

#include "kernels/merge_states.h"

namespace attnserve {

cudaError_t MergeStatesCuda(const MergeStatesParams& params, cudaStream_t stream);

}  // namespace attnserve
