#include "kernels/fast_div.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace attnserve {
namespace {

// Every divisor the kernels use (GQA groups, page sizes) and the hard ones
// (powers of two and their neighbours, large primes), against the numerators
// where a rounding error would first show: multiples of d and their
// neighbours, the top of the 31-bit range, and random values.
TEST(FastDiv, MatchesIntegerDivision) {
  std::vector<int32_t> divisors;
  for (int32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int s = 12; s <= 30; ++s) {
    divisors.push_back((1 << s) - 1);
    divisors.push_back(1 << s);
    divisors.push_back((1 << s) + 1);
  }
  divisors.push_back(2147483647);
  divisors.push_back(1000003);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> any(0, INT32_MAX);
  for (int32_t d : divisors) {
    const FastDiv f(d);
    auto check = [&](int64_t n) {
      if (n < 0 || n > INT32_MAX) return;
      const int32_t v = static_cast<int32_t>(n);
      ASSERT_EQ(f.Div(v), v / d) << "n=" << v << " d=" << d;
      ASSERT_EQ(f.Mod(v), v % d) << "n=" << v << " d=" << d;
    };
    for (int64_t n = 0; n < 64; ++n) check(n);
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{INT32_MAX} / d, int64_t{INT32_MAX} / d - 1}) {
      for (int64_t e = -2; e <= 2; ++e) check(k * d + e);
    }
    for (int64_t n = INT32_MAX - 64; n <= INT32_MAX; ++n) check(n);
    for (int i = 0; i < 256; ++i) check(any(rng));
  }
}

}  // namespace
}  // namespace attnserve
