// Constants of the base-2 softmax shared by every kernel family (CPU and
// CUDA): logits are scaled by kLog2e so that exp becomes exp2, and a base-2
// LSE becomes a natural one by multiplying with kLn2.
#pragma once

namespace attnserve {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

}  // namespace attnserve
