#include "common/dtype.h"

#include <cstring>

namespace attnserve {

// IEEE binary16 by bit manipulation (clang 14 has no _Float16 on x86-64).
float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf or NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);  // 112 = 127 - 15
  } else if (mant == 0) {
    bits = sign;  // signed zero
  } else {  // subnormal: normalise
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToFp16(float value) {
  uint32_t x;
  std::memcpy(&x, &value, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int e = static_cast<int>(exp) - 112;  // re-biased exponent
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
  if (e <= 0) {  // subnormal half (or zero)
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const int shift = 14 - e;
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // a carry may reach inf: right
  return static_cast<uint16_t>(half);
}

void HalfToFloatN(KvDType dtype, const uint16_t* in, float* out, int64_t n) {
  if (dtype == KvDType::kBf16) {
    for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = Fp16ToFloat(in[i]);
  }
}

}  // namespace attnserve
