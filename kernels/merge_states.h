// N-way merge of attention states (o_i, lse_i), shared by the CPU reference
// (MergeStatesCpu) and the CUDA kernels.
//
//   m = max_i lse_i,  w_i = base^(lse_i - m),
//   o = sum_i w_i o_i / sum_i w_i,  lse = m + log_base(sum_i w_i)
// A -inf state contributes nothing; when every state is -inf the result is
// (0, -inf). Never NaN from finite or -inf inputs. fp32 math.
#pragma once

#include <cstdint>

#include "common/kv_geometry.h"

namespace attnserve {

struct MergeStatesParams {
  const void* const* v = nullptr;     // (num_states) pointers to (n, h, d), dtype
  const float* const* lse = nullptr;  // (num_states) pointers to (n, h), float32
  int32_t num_states = 0;
  void* v_out = nullptr;              // (n, h, d), dtype
  float* lse_out = nullptr;           // (n, h), float32
  int64_t n = 0;
  int32_t h = 0;
  int32_t d = 0;
  KvDType dtype = KvDType::kBf16;
  uint8_t lse_base_e = 0;             // 1: LSEs are natural log; 0: base 2
};

void MergeStatesCpu(const MergeStatesParams& params);

}  // namespace attnserve
