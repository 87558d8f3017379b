// Helpers shared by the CPU kernel tests: random half data, poisoning and
// the float64 comparisons of docs/design.md section 3.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/kv_geometry.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace testing_util {

inline constexpr double kNegInf = -std::numeric_limits<double>::infinity();

inline const char* DTypeName(KvDType dtype) {
  return dtype == KvDType::kBf16 ? "bf16" : "fp16";
}

// n random 16-bit values from N(0, stddev^2), redrawn until nonzero so that
// no test data is ever zero (a kernel that drops a term must not get lucky).
inline std::vector<uint16_t> RandomNonzeroHalves(std::mt19937_64& gen, KvDType dtype, int64_t n,
                                                 double stddev = 1.0) {
  std::normal_distribution<float> dist(0.f, static_cast<float>(stddev));
  std::vector<uint16_t> out(n);
  for (auto& x : out) {
    do {
      x = FloatToHalf(dtype, dist(gen));
    } while (HalfToFloat(dtype, x) == 0.f);
  }
  return out;
}

// Fills a buffer with 0xFF bytes: NaN as bf16, fp16 and float32, so that any
// element a kernel forgets to write fails the comparison.
template <typename T>
void Poison(std::vector<T>& v) {
  std::memset(v.data(), 0xFF, v.size() * sizeof(T));
}

inline bool IsPoisonHalf(uint16_t x) { return x == 0xFFFF; }
inline bool IsPoisonFloat(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u == 0xFFFFFFFFu;
}

// ||got - ref|| / ||ref|| over a half tensor against a float64 one. NaN in
// `got` makes the result NaN, which fails every `< tol` assertion.
inline double RelNormError(KvDType dtype, const uint16_t* got, const double* ref, int64_t n) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = HalfToFloat(dtype, got[i]);
    diff += (x - ref[i]) * (x - ref[i]);
    norm += ref[i] * ref[i];
  }
  if (norm == 0) return std::sqrt(diff);
  return std::sqrt(diff / norm);
}

}  // namespace testing_util
}  // namespace attnserve
