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

float Fp16ToFloat(uint16_t bits);
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
