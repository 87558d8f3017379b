// FP8 formats of the KV cache: the bit-level conversions, written once for
// host and device code (docs/design.md section 3, "FP8 KV cache").
//
// Formats (OCP 8-bit floating point, as PyTorch's float8_e4m3fn and
// float8_e5m2, FlashInfer's and vLLM's FP8 KV caches):
//  - E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits. No infinities;
//    S.1111.111 is NaN. Largest finite 448 (0x7E), smallest normal 2^-6,
//    smallest subnormal 2^-9.
//  - E5M2: sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like:
//    S.11111.00 is infinite, S.11111.xx (xx != 0) NaN. Largest finite 57344
//    (0x7B), smallest normal 2^-14, smallest subnormal 2^-16.
//
// Scales (vLLM's and FlashInfer's convention): real value = fp8 value x
// scale. Quantizing x with scale s stores x / s, computed exactly (in
// double: the quotient of two floats is never close enough to a midpoint of
// the FP8 grid for double's rounding to move it across one), rounded to the
// nearest FP8 value, ties to even. Magnitudes above the largest finite value
// saturate to it, infinities included (never NaN from a finite input); a
// NaN input stores 0x7F (NaN in both formats); zero keeps its sign.
//
//   uint8_t b = Fp8Quantize(Fp8Format::kE4m3, x, k_scale);   // one element
//   float real = Fp8ToFloat(Fp8Format::kE4m3, b) * k_scale;  // exact, then one rounding
//
// Kernels reading an FP8 pool may instead fold K's scale into the logit
// scale (LogitTransform::Of's k_scale, kernels/variant.h) and V's into the
// output (acc * o_scale * v_scale), as FlashInfer's FA2 path does.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/kv_geometry.h"

#if defined(__CUDACC__)
#define ATTN_FP8_HD __host__ __device__ __forceinline__
#else
#define ATTN_FP8_HD inline
#endif

namespace attnserve {
namespace fp8_detail {

ATTN_FP8_HD uint64_t DoubleBits(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

ATTN_FP8_HD float FloatOfBits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Round-to-nearest-even encoding of x into a format of E exponent bits
// (bias 2^(E-1) - 1) and M mantissa bits whose largest finite magnitude has
// the bit pattern kMaxFinite, saturating there.
template <int E, int M, uint32_t kMaxFinite>
ATTN_FP8_HD uint8_t EncodeDouble(double x) {
  const uint64_t u = DoubleBits(x);
  const uint32_t sign = static_cast<uint32_t>(u >> 63) << 7;
  const uint64_t a = u & 0x7fffffffffffffffull;
  if (a > 0x7ff0000000000000ull) return 0x7f;                       // NaN
  if (a == 0x7ff0000000000000ull) return static_cast<uint8_t>(sign | kMaxFinite);  // +-inf
  const int32_t exp_field = static_cast<int32_t>(a >> 52);
  if (exp_field == 0) return static_cast<uint8_t>(sign);  // zero, or a double subnormal: rounds to 0
  constexpr int32_t kBias = (1 << (E - 1)) - 1;
  constexpr int32_t kEmin = 1 - kBias;  // exponent of the smallest normal
  const int32_t e = exp_field - 1023;   // x = mant * 2^(e - 52)
  const uint64_t mant = (uint64_t{1} << 52) | (a & ((uint64_t{1} << 52) - 1));
  // Keep M fraction bits below the leading one, or fewer for a subnormal.
  const int32_t e_eff = e > kEmin ? e : kEmin;
  const int32_t shift = 52 - M + (e_eff - e);
  if (shift >= 54) return static_cast<uint8_t>(sign);  // below half the smallest subnormal
  uint64_t r = mant >> shift;
  const uint64_t rem = mant & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  if (rem > half || (rem == half && (r & 1) != 0)) ++r;
  // r counts quanta of 2^(e_eff - M), the hidden bit included for a normal:
  // the exponent field and the mantissa follow by one addition (a carry out
  // of the mantissa moves to the next exponent; a subnormal that rounds up
  // becomes the smallest normal).
  const int64_t bits = (int64_t{e_eff - kEmin} << M) + static_cast<int64_t>(r);
  const uint32_t mag = bits > static_cast<int64_t>(kMaxFinite) ? kMaxFinite
                                                               : static_cast<uint32_t>(bits);
  return static_cast<uint8_t>(sign | mag);
}

}  // namespace fp8_detail

// x (any double) as E4M3 / E5M2 bits: round to nearest even, saturating.
ATTN_FP8_HD uint8_t DoubleToFp8E4m3(double x) {
  return fp8_detail::EncodeDouble<4, 3, 0x7e>(x);
}
ATTN_FP8_HD uint8_t DoubleToFp8E5m2(double x) {
  return fp8_detail::EncodeDouble<5, 2, 0x7b>(x);
}
ATTN_FP8_HD uint8_t DoubleToFp8(Fp8Format format, double x) {
  return format == Fp8Format::kE5m2 ? DoubleToFp8E5m2(x) : DoubleToFp8E4m3(x);
}

// The value of E4M3 / E5M2 bits (exact in float).
ATTN_FP8_HD float Fp8E4m3ToFloat(uint8_t b) {
  const uint32_t sign = uint32_t{b & 0x80u} << 24;
  const uint32_t e = (b >> 3) & 0xfu;
  const uint32_t m = b & 0x7u;
  if (e == 0xf && m == 0x7) return fp8_detail::FloatOfBits(0x7fc00000u);  // NaN
  if (e == 0) {  // subnormal or zero: m * 2^-9
    const float v = static_cast<float>(m) * 0.001953125f;
    return sign != 0 ? -v : v;
  }
  return fp8_detail::FloatOfBits(sign | ((e + 120u) << 23) | (m << 20));  // 120 = 127 - 7
}
ATTN_FP8_HD float Fp8E5m2ToFloat(uint8_t b) {
  const uint32_t sign = uint32_t{b & 0x80u} << 24;
  const uint32_t e = (b >> 2) & 0x1fu;
  const uint32_t m = b & 0x3u;
  if (e == 0x1f) return fp8_detail::FloatOfBits(sign | 0x7f800000u | (m != 0 ? 0x400000u : 0u));
  if (e == 0) {  // subnormal or zero: m * 2^-16
    const float v = static_cast<float>(m) * 1.52587890625e-05f;
    return sign != 0 ? -v : v;
  }
  return fp8_detail::FloatOfBits(sign | ((e + 112u) << 23) | (m << 21));  // 112 = 127 - 15
}
ATTN_FP8_HD float Fp8ToFloat(Fp8Format format, uint8_t b) {
  return format == Fp8Format::kE5m2 ? Fp8E5m2ToFloat(b) : Fp8E4m3ToFloat(b);
}

// The stored byte of real value x under scale s (> 0, finite): x / s in
// double, then DoubleToFp8. The one quantizer of WriteKV and fused appends
// on every backend.
ATTN_FP8_HD uint8_t Fp8Quantize(Fp8Format format, float x, float scale) {
  return DoubleToFp8(format, static_cast<double>(x) / static_cast<double>(scale));
}

// The power of two 2^e by which the FP8-query prefill kernel
// (PrefillKernel::kSm90Fp8Q) multiplies a query row before it rounds the row
// to E4M3 (to nearest, ties to even, saturating), from the row's largest
// finite |q| (amax): amax 2^e lands in [128, 256), below E4M3's largest
// finite 448, so no finite element saturates and the row's elements above
// amax 2^-13 stay normal. The row's logit multiplier takes 2^-e back. e is
// clamped to [-100, 100], as QHalfExponent's (LogitTransform::TimesPow2):
// rows whose largest |q| is below 2^-93 keep fewer bits, elements of rows
// whose largest |q| is 2^108 or more may saturate to +-448 2^-e, as infinite
// elements do. amax 0 (or no finite element) gives e = 0.
ATTN_FP8_HD int QFp8Exponent(float amax) {
  if (!(amax > 0.f)) return 0;
  uint32_t bits;
#if defined(__CUDA_ARCH__)
  bits = __float_as_uint(amax);
#else
  std::memcpy(&bits, &amax, sizeof(bits));
#endif
  const int biased = static_cast<int>((bits >> 23) & 0xffu);  // 0: subnormal
  if (biased == 0xff) return 0;
  const int e = biased == 0 ? 100 : 134 - biased;              // 7 - ilogb(amax)
  return e < -100 ? -100 : (e > 100 ? 100 : e);
}

// 16-bit rows as floats (exact), for code that quantizes them on the device
// as well as the host (common/dtype.h has the host-only versions).
ATTN_FP8_HD float Bf16BitsToFloat(uint16_t bits) {
  return fp8_detail::FloatOfBits(uint32_t{bits} << 16);
}
ATTN_FP8_HD float Fp16BitsToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return fp8_detail::FloatOfBits(sign | 0x7f800000u | (m << 13));  // inf, NaN
  if (e == 0) {  // subnormal or zero: m * 2^-24
    const float v = static_cast<float>(m) * 5.9604644775390625e-08f;
    return sign != 0 ? -v : v;
  }
  return fp8_detail::FloatOfBits(sign | ((e + 112u) << 23) | (m << 13));
}
ATTN_FP8_HD float HalfBitsToFloat(KvDType dtype, uint16_t bits) {
  return dtype == KvDType::kBf16 ? Bf16BitsToFloat(bits) : Fp16BitsToFloat(bits);
}

// The dequantization scale of (layer, KV head) in a (num_layers,
// num_kv_heads) array of scales (PagedPrefillParams::k_scales, v_scales);
// 1 when there is none. Every family reads its scales through this.
ATTN_FP8_HD float KvScaleAt(const float* scales, int32_t layer, int32_t num_kv_heads, int32_t kv_head) {
  if (scales == nullptr) return 1.f;
  const float* at = scales + static_cast<int64_t>(layer) * num_kv_heads + kv_head;
#if defined(__CUDA_ARCH__)
  return __ldg(at);
#else
  return *at;
#endif
}

}  // namespace attnserve
