// The base-2 softmax's constants and numerics, shared by every kernel family
// (CPU and CUDA): logits are scaled by kLog2e so that exp becomes exp2, and a
// base-2 LSE becomes a natural one by multiplying with kLn2. On the device
// the functions are the hardware's approximations, on the host the library's.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTN_HOST_DEVICE inline
#endif

namespace attnserve {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// 2^x: one MUFU operation on the device (a few ulp, flushing subnormals).
ATTN_HOST_DEVICE float Exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// a / b (b in the normal range: l >= 1 whenever a row saw a key).
ATTN_HOST_DEVICE float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdividef(a, b);
#else
  return a / b;
#endif
}

// log2(x).
ATTN_HOST_DEVICE float Log2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::log2(x);
#endif
}

}  // namespace attnserve
