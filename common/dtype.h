// Host conversions between bf16 / fp16 bit patterns and float.
// Round to nearest even; NaN stays NaN; infinities stay infinite.
#pragma once

#include <cstdint>

#include "common/kv_geometry.h"

namespace attnserve {

float Bf16ToFloat(uint16_t bits);
uint16_t FloatToBf16(float value);
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
