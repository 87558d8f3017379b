// Device numerics shared by every CUDA kernel family: 16-bit conversions and
// the swizzle of shared-memory tiles. (Exp2, Div, Log2 and the
// base-2 constants are host-and-device, in kernels/math.h.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/math.h"

namespace attnserve {

// Two floats -> one register of two 16-bit values (lo = x), rounded to nearest.
template <typename T>
__device__ __forceinline__ uint32_t Pack2(float x, float y);
template <>
__device__ __forceinline__ uint32_t Pack2<__nv_bfloat16>(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t Pack2<__half>(float x, float y) {
  __half2 v = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}

// One register of two 16-bit values -> two floats (x = lo), exactly.
template <typename T>
__device__ __forceinline__ float2 Unpack2(uint32_t w);
template <>
__device__ __forceinline__ float2 Unpack2<__nv_bfloat16>(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 Unpack2<__half>(uint32_t w) {
  __half2 v = *reinterpret_cast<__half2*>(&w);
  return __half22float2(v);
}

template <typename T>
__device__ __forceinline__ float ToFloat(T x);
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float ToFloat<__half>(__half x) {
  return __half2float(x);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}

// Byte offset of 16-byte chunk c of row r in a tile of ROW_BYTES-byte rows,
// swizzled so that eight consecutive rows' chunk c fall in different banks
// (the sm80 and decode families' cp.async / ldmatrix tiles).
template <int ROW_BYTES>
__host__ __device__ __forceinline__ constexpr uint32_t Swz(int r, int c) {
  return r * ROW_BYTES + ((c ^ (r & 7)) << 4);
}

}  // namespace attnserve
