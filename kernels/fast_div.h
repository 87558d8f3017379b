// Division of non-negative 31-bit integers by a divisor fixed for a launch
// (query heads per KV head, page size) as a multiply-high and a shift, for
// kernels whose per-tile index arithmetic would otherwise run a full integer
// division sequence (about twenty dependent instructions) each time.
//
// For a divisor d >= 2 with s = ceil(log2 d): mul = ceil(2^(31 + s) / d),
// which is below 2^32 because 2^s < 2d, and n / d = (n * mul) >> (31 + s)
// for every n < 2^31 (the rounding error n * (mul * d - 2^(31 + s)) is
// below n * d < 2^(31 + s)). d = 1 is kept apart (mul would need 33 bits).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTNSERVE_HD __host__ __device__ __forceinline__
#else
#define ATTNSERVE_HD inline
#endif

namespace attnserve {

struct FastDiv {
  int32_t d = 1;
  uint32_t mul = 0;
  uint32_t shift = 0;  // s - 1 (applied to the high word of n * mul)

  FastDiv() = default;
  // d >= 1.
  explicit FastDiv(int32_t divisor) : d(divisor) {
    if (d <= 1) return;
    uint32_t s = 0;
    while ((int64_t{1} << s) < d) ++s;
    const uint64_t num = uint64_t{1} << (31 + s);
    mul = static_cast<uint32_t>((num + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d));
    shift = s - 1;
  }

  // n / d for 0 <= n < 2^31.
  ATTNSERVE_HD int32_t Div(int32_t n) const {
    if (d == 1) return n;
#if defined(__CUDA_ARCH__)
    return static_cast<int32_t>(__umulhi(static_cast<uint32_t>(n), mul) >> shift);
#else
    return static_cast<int32_t>(((static_cast<uint64_t>(static_cast<uint32_t>(n)) * mul) >> 32) >> shift);
#endif
  }
  // n % d for 0 <= n < 2^31.
  ATTNSERVE_HD int32_t Mod(int32_t n) const { return n - Div(n) * d; }
};

}  // namespace attnserve

#undef ATTNSERVE_HD
