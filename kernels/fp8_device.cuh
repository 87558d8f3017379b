// FP8 bytes read by the CUDA kernels (docs/design.md section 3, "FP8 KV
// cache"): exact conversions to 16-bit pairs, and the power of two that
// carries a bf16 query row into fp16 (the decode family and the sm90
// prefill family's FP8 kernels run S = Q K^T in fp16 on FP8 pools).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common/kv_geometry.h"
#include "kernels/fp8.h"

namespace attnserve {

// Four FP8 values (bytes of w) as two pairs of T, exactly: lo holds bytes 0
// and 1 (byte 0 in the low half), hi bytes 2 and 3. Each byte becomes the
// high byte of a 16-bit half; its exponent and mantissa move into T's
// fields, which leaves the value times 2^-(difference of the biases), a
// multiplication by that power of two (exact: every FP8 value is a normal
// T) restores it. E5M2 is an fp16's high byte as it is. NaN bytes (only
// from NaN rows) read as finite values here.
template <int F8, typename T>
__device__ __forceinline__ uint32_t Fp8HalvesToT(uint32_t t) {
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if (F8 == static_cast<int>(Fp8Format::kE5m2) && kHalf) return t;
  constexpr bool kE4m3 = F8 == static_cast<int>(Fp8Format::kE4m3);
  constexpr int kShift = kHalf ? 1 : kE4m3 ? 4 : 3;
  constexpr uint32_t kMask = kHalf ? 0x3f803f80u : kE4m3 ? 0x07f007f0u : 0x0fe00fe0u;
  const uint32_t bits = ((t >> kShift) & kMask) | (t & 0x80008000u);
  uint32_t out;
  if (kHalf) {  // x 2^8
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(bits), "r"(0x5c005c00u));
  } else {  // x 2^120 (E4M3) or 2^112 (E5M2), as an fma with -0
    constexpr uint32_t kPow = kE4m3 ? 0x7b807b80u : 0x77807780u;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(bits), "r"(kPow), "r"(0x80008000u));
  }
  return out;
}
template <int F8, typename T>
__device__ __forceinline__ void Fp8x4ToT(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = Fp8HalvesToT<F8, T>(__byte_perm(w, 0u, 0x1404));
  hi = Fp8HalvesToT<F8, T>(__byte_perm(w, 0u, 0x3424));
}

// The same as fp16 pairs (exact), by the hardware's conversion on sm_89+
// for E4M3 (one instruction a pair; NaN stays NaN).
template <int F8>
__device__ __forceinline__ void Fp8x4ToHalf(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (F8 == static_cast<int>(Fp8Format::kE4m3)) {
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    lo = uint32_t{a.x} | (uint32_t{a.y} << 16);
    hi = uint32_t{b.x} | (uint32_t{b.y} << 16);
    return;
  }
#endif
  Fp8x4ToT<F8, __half>(w, lo, hi);
}

// The same, E4M3 written as the conversion instruction on the word's two
// 16-bit halves (the sm90 prefill family's in-place stage conversion,
// kernels/sm90/fp8_tiles.cuh, measured 4-6% faster with it on the H200,
// bench/results/2026-12-03-session17-h200.md; the decode family keeps
// Fp8x4ToHalf: one run with this form there was inconclusive).
template <int F8>
__device__ __forceinline__ void Fp8x4ToHalfRegs(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (F8 == static_cast<int>(Fp8Format::kE4m3)) {
    asm("{.reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
    return;
  }
#endif
  Fp8x4ToHalf<F8>(w, lo, hi);
}

// bf16 queries over an FP8 pool are multiplied by 2^e and stored as fp16,
// so that S = Q K^T runs in fp16 with K in the hardware's conversion; e is
// chosen per query row (and head) and the row's logit scale takes 2^-e
// back. amax is the row's largest finite |q|; e puts it in [2^14, 2^15):
// then every element of at least 2^-28 amax converts exactly (fp16's 11
// significant bits hold bf16's 8) and a smaller one rounds to fp16's
// subnormal grid with an error below 2^-39 amax. e is clamped to +-100 (2^-e
// times the logit scale stays a normal float), so rows whose largest |q| is
// 2^116 or more overflow fp16; zero amax gives e = 0; a NaN or an infinity
// stays one.
__device__ __forceinline__ float FiniteAbs(float x) { return fabsf(x) <= 3.4028235e38f ? fabsf(x) : 0.f; }
__device__ __forceinline__ int QHalfExponent(float amax) {
  if (!(amax > 0.f) || !(amax <= 3.0e38f)) return 0;
  return max(-100, min(100, 14 - ilogbf(amax)));
}

}  // namespace attnserve
