// Host conversions between bf16 / fp16 bit patterns and float.
// Round to nearest even; NaN stays NaN; infinities stay infinite.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/kv_geometry.h"

namespace attnserve {

// Inline: loops over rows (the CPU merge, packing) vectorize through them.
inline float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t FloatToBf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16 -> float, exactly (subnormals, signed zeros, infinities and
// NaN payloads included), without branches so that loops over it vectorize:
// the 15 magnitude bits shifted into a float's place are the value times
// 2^-112 (exponent bias 15 against 127; a half subnormal becomes a float
// subnormal), so one multiply by 2^112 rebiases them; an all-ones exponent
// takes the float's all-ones exponent instead. Needs subnormal arithmetic
// (no flush-to-zero or denormals-are-zero mode).
inline float Fp16ToFloat(uint16_t bits) {
  const uint32_t shifted = uint32_t{bits & 0x7fffu} << 13;
  float magnitude;
  std::memcpy(&magnitude, &shifted, sizeof(magnitude));
  magnitude *= 0x1p112f;
  uint32_t out;
  std::memcpy(&out, &magnitude, sizeof(out));
  // All ones where the exponent is all ones (0x7c00 + 0x400 carries into
  // bit 15 only then), as arithmetic: a select the vectorizer takes.
  const uint32_t special = 0u - ((uint32_t{bits & 0x7c00u} + 0x400u) >> 15);
  out = (out & ~special) | ((shifted | 0x7f800000u) & special);
  out |= uint32_t{bits & 0x8000u} << 16;
  float f;
  std::memcpy(&f, &out, sizeof(f));
  return f;
}
uint16_t FloatToFp16(float value);

inline float HalfToFloat(KvDType dtype, uint16_t bits) {
  return dtype == KvDType::kBf16 ? Bf16ToFloat(bits) : Fp16ToFloat(bits);
}
inline uint16_t FloatToHalf(KvDType dtype, float value) {
  return dtype == KvDType::kBf16 ? FloatToBf16(value) : FloatToFp16(value);
}

// Converts n 16-bit values to float.
void HalfToFloatN(KvDType dtype, const uint16_t* in, float* out, int64_t n);

}  // namespace attnserve
