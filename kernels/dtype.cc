#include "kernels/dtype.h"

#include <cstring>

namespace attnserve {

float Bf16ToFloat(uint16_t bits) {
  uint32_t u = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint16_t FloatToBf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// _Float16 is the compiler's IEEE binary16 (GCC >= 12 on x86-64).
float Fp16ToFloat(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}

uint16_t FloatToFp16(float value) {
  _Float16 h = static_cast<_Float16>(value);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}

void HalfToFloatN(KvDType dtype, const uint16_t* in, float* out, int64_t n) {
  if (dtype == KvDType::kBf16) {
    for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = Fp16ToFloat(in[i]);
  }
}

}  // namespace attnserve
