#include "common/dtype.h"

#include <cstring>

namespace attnserve {

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
