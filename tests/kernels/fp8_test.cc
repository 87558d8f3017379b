// kernels/fp8.h, the one FP8 quantizer, against an encoder written here from
// the formats' definitions (nearest representable value by search, ties to
// the even bit pattern, saturation at the largest finite value), on every
// bf16 and fp16 bit pattern, for E4M3 and E5M2; its decoder against the
// float64 reference's (common/reference.h, written apart); scales; and the
// CPU append and gather kernels on FP8 pools (kernels/append_kv.h).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/reference.h"
#include "gtest/gtest.h"
#include "kernels/append_kv.h"
#include "kernels/fp8.h"

namespace attnserve {
namespace {

// A format as its definition gives it: every finite value and its bits.
struct Format {
  Fp8Format id;
  int exp_bits;
  int man_bits;
  bool has_inf;  // E5M2: S.11111.00; E4M3 has none (S.1111.111 is NaN)
  uint8_t max_bits;
  double max_value;
  std::vector<double> values;     // positive finite values, ascending, value[i] has bits i
  std::vector<uint8_t> value_bits;

  static Format Of(Fp8Format id) {
    Format f;
    f.id = id;
    f.exp_bits = id == Fp8Format::kE5m2 ? 5 : 4;
    f.man_bits = 7 - f.exp_bits;
    f.has_inf = id == Fp8Format::kE5m2;
    const int bias = (1 << (f.exp_bits - 1)) - 1;
    for (int bits = 0; bits < 128; ++bits) {
      const int e = bits >> f.man_bits;
      const int m = bits & ((1 << f.man_bits) - 1);
      const int e_max = (1 << f.exp_bits) - 1;
      if (f.has_inf && e == e_max) break;                                      // inf, NaN
      if (!f.has_inf && e == e_max && m == (1 << f.man_bits) - 1) break;       // NaN
      // (-1)^s 2^(e - bias) (1 + m / 2^M); subnormal: 2^(1 - bias) (m / 2^M).
      const double frac = std::ldexp(static_cast<double>(m), -f.man_bits);
      const double v = e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, e - bias);
      f.values.push_back(v);
      f.value_bits.push_back(static_cast<uint8_t>(bits));
    }
    f.max_bits = f.value_bits.back();
    f.max_value = f.values.back();
    return f;
  }

  // The encoding of x: NaN -> 0x7F; |x| at or beyond the largest finite
  // value (infinities included) -> +-max; otherwise the nearest value, ties
  // to the even bit pattern; the sign kept (zero included).
  uint8_t Encode(double x) const {
    if (std::isnan(x)) return 0x7f;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    const double a = std::fabs(x);
    if (a >= max_value) return sign | max_bits;
    size_t best = 0;
    for (size_t i = 1; i < values.size(); ++i) {
      const double d_best = std::fabs(a - values[best]);
      const double d = std::fabs(a - values[i]);
      if (d < d_best || (d == d_best && (value_bits[i] & 1) == 0)) best = i;
    }
    return sign | value_bits[best];
  }
};

std::string Name(Fp8Format f) { return Fp8FormatName(f); }

class QuantizerTest : public ::testing::TestWithParam<Fp8Format> {};

// Every bf16 bit pattern (its value is exact in float): NaNs, infinities,
// signed zeros, bf16 subnormals, values that saturate, underflow to zero or
// land on ties.
TEST_P(QuantizerTest, EveryBf16PatternMatchesTheDefinition) {
  const Format f = Format::Of(GetParam());
  int64_t ties = 0, saturated = 0, subnormal = 0;
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float x = Bf16ToFloat(static_cast<uint16_t>(bits));
    const uint8_t want = f.Encode(x);
    const uint8_t got = Fp8Quantize(f.id, x, 1.f);
    ASSERT_EQ(got, want) << Name(f.id) << " bf16 bits 0x" << std::hex << bits << " = " << x;
    // The device-callable path (16-bit bits to float) agrees with the host's.
    const float x2 = HalfBitsToFloat(KvDType::kBf16, static_cast<uint16_t>(bits));
    ASSERT_EQ(std::memcmp(&x, &x2, sizeof(x)), 0);
    const double a = std::fabs(x);
    if (std::isfinite(a) && a >= f.max_value) ++saturated;
    if ((want & 0x7f) != 0 && (want & 0x7f) < (1 << f.man_bits)) ++subnormal;
    for (size_t i = 0; i + 1 < f.values.size(); ++i) {
      if (a == (f.values[i] + f.values[i + 1]) / 2) ++ties;
    }
  }
  // The sweep covers what it is meant to.
  EXPECT_GT(ties, 0);
  EXPECT_GT(saturated, 0);
  EXPECT_GT(subnormal, 0);
}

// Every fp16 bit pattern (also exact in float).
TEST_P(QuantizerTest, EveryFp16PatternMatchesTheDefinition) {
  const Format f = Format::Of(GetParam());
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float x = Fp16ToFloat(static_cast<uint16_t>(bits));
    const float x2 = HalfBitsToFloat(KvDType::kFp16, static_cast<uint16_t>(bits));
    ASSERT_TRUE(std::memcmp(&x, &x2, sizeof(x)) == 0 || (std::isnan(x) && std::isnan(x2)))
        << "fp16 bits 0x" << std::hex << bits;
    ASSERT_EQ(Fp8Quantize(f.id, x, 1.f), f.Encode(x))
        << Name(f.id) << " fp16 bits 0x" << std::hex << bits << " = " << x;
  }
}

// common/dtype.h's branch-free Fp16ToFloat against the format's definition,
// bit for bit (NaN payloads, signed zeros and subnormals included).
TEST(Fp16ToFloatTest, EveryPatternIsExact) {
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint32_t sign = (bits & 0x8000u) << 16, exp = (bits >> 10) & 0x1fu, mant = bits & 0x3ffu;
    uint32_t want;
    if (exp == 0x1f) {
      want = sign | 0x7f800000u | (mant << 13);
    } else {
      // (implicit one + mantissa) x 2^(exp - 25), or mantissa x 2^-24 below.
      const float magnitude = exp == 0 ? std::ldexp(static_cast<float>(mant), -24)
                                       : std::ldexp(static_cast<float>(1024 + mant), int(exp) - 25);
      std::memcpy(&want, &magnitude, sizeof(want));
      want |= sign;
    }
    const float got = Fp16ToFloat(static_cast<uint16_t>(bits));
    uint32_t got_bits;
    std::memcpy(&got_bits, &got, sizeof(got_bits));
    ASSERT_EQ(got_bits, want) << "fp16 bits 0x" << std::hex << bits;
  }
}

TEST_P(QuantizerTest, SpecialValues) {
  const Format f = Format::Of(GetParam());
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(Fp8Quantize(f.id, inf, 1.f), f.max_bits);
  EXPECT_EQ(Fp8Quantize(f.id, -inf, 1.f), 0x80 | f.max_bits);
  EXPECT_EQ(Fp8Quantize(f.id, nan, 1.f), 0x7f);
  EXPECT_EQ(Fp8Quantize(f.id, -nan, 1.f), 0x7f);
  EXPECT_EQ(Fp8Quantize(f.id, 0.f, 1.f), 0x00);
  EXPECT_EQ(Fp8Quantize(f.id, -0.f, 1.f), 0x80);
  EXPECT_EQ(Fp8Quantize(f.id, std::numeric_limits<float>::max(), 1.f), f.max_bits);
  EXPECT_EQ(Fp8Quantize(f.id, std::numeric_limits<float>::denorm_min(), 1.f), 0x00);
  EXPECT_EQ(Fp8Quantize(f.id, -std::numeric_limits<float>::denorm_min(), 1.f), 0x80);
  // The largest finite value, and never NaN from a finite input.
  EXPECT_EQ(f.max_value, f.id == Fp8Format::kE4m3 ? 448.0 : 57344.0);
  for (float x : {float(f.max_value) * 1.5f, 1e5f, 3e38f, -3e38f}) {
    const uint8_t b = Fp8Quantize(f.id, x, 1.f);
    EXPECT_FALSE(std::isnan(Fp8ToFloat(f.id, b))) << x;
    EXPECT_EQ(std::fabs(Fp8ToFloat(f.id, b)), f.max_value) << x;
  }
}

// The decoder against the float64 reference's decoder (common/reference.cc),
// and every finite value encodes back to its own bits.
TEST_P(QuantizerTest, EveryPatternDecodesAsTheReferenceAndRoundTrips) {
  const Format f = Format::Of(GetParam());
  for (int bits = 0; bits < 256; ++bits) {
    const uint8_t b = static_cast<uint8_t>(bits);
    const float got = Fp8ToFloat(f.id, b);
    const double want = reference::Fp8Value(f.id, b);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "0x" << std::hex << bits;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << Name(f.id) << " 0x" << std::hex << bits;
    EXPECT_EQ(std::signbit(got), (bits & 0x80) != 0) << "0x" << std::hex << bits;
    if (std::isinf(want)) continue;  // E5M2's infinities saturate (SpecialValues)
    EXPECT_EQ(Fp8Quantize(f.id, got, 1.f), b) << "0x" << std::hex << bits;
  }
}

// Power-of-two scales divide exactly: quantizing x with scale s is encoding
// x / s, for every bf16 pattern.
TEST_P(QuantizerTest, PowerOfTwoScales) {
  const Format f = Format::Of(GetParam());
  for (float s : {0.0625f, 0.5f, 2.f, 1024.f, std::ldexp(1.f, -100), std::ldexp(1.f, 100)}) {
    for (uint32_t bits = 0; bits < 65536; bits += 3) {
      const float x = Bf16ToFloat(static_cast<uint16_t>(bits));
      ASSERT_EQ(Fp8Quantize(f.id, x, s), f.Encode(static_cast<double>(x) / s))
          << "x=" << x << " scale=" << s;
    }
  }
}

// Any scale: the quotient is rounded once, exactly. Cases where float32
// division would land exactly on a midpoint of the FP8 grid while the exact
// quotient lies off it are found and checked against the exact answer,
// which needs no division: the sign of x - midpoint * s (exact in double).
TEST_P(QuantizerTest, ArbitraryScalesRoundTheExactQuotient) {
  const Format f = Format::Of(GetParam());
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<float> scale_dist(0.01f, 100.f);
  int64_t double_rounding_cases = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const float s = scale_dist(gen);
    // A midpoint between two adjacent values, and x the float nearest its
    // product with s.
    const size_t i = std::uniform_int_distribution<size_t>(0, f.values.size() - 2)(gen);
    const double mid = (f.values[i] + f.values[i + 1]) / 2;
    const float x = static_cast<float>(mid * s);
    const double exact_diff = static_cast<double>(x) - mid * static_cast<double>(s);
    uint8_t want;
    if (exact_diff > 0) {
      want = f.value_bits[i + 1];
    } else if (exact_diff < 0) {
      want = f.value_bits[i];
    } else {
      want = (f.value_bits[i] & 1) == 0 ? f.value_bits[i] : f.value_bits[i + 1];
    }
    ASSERT_EQ(Fp8Quantize(f.id, x, s), want) << "x=" << x << " scale=" << s << " mid=" << mid;
    ASSERT_EQ(Fp8Quantize(f.id, -x, s), 0x80 | want);
    if (exact_diff != 0 && x / s == static_cast<float>(mid)) ++double_rounding_cases;
  }
  // Float32 division would have rounded some of these wrong.
  EXPECT_GT(double_rounding_cases, 0);
  // And random values against the definition applied to the quotient.
  std::normal_distribution<float> value(0.f, 300.f);
  for (int trial = 0; trial < 20000; ++trial) {
    const float s = scale_dist(gen), x = value(gen);
    ASSERT_EQ(Fp8Quantize(f.id, x, s), f.Encode(static_cast<double>(x) / s));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizerTest,
                         ::testing::Values(Fp8Format::kE4m3, Fp8Format::kE5m2),
                         [](const ::testing::TestParamInfo<Fp8Format>& info) {
                           return info.param == Fp8Format::kE4m3 ? std::string("E4m3")
                                                                 : std::string("E5m2");
                         });

// AppendKvCpu quantizes 16-bit rows with each (layer, head)'s scale, stores
// FP8 rows as they are, and GatherKvCpu returns the stored bytes or the
// dequantized rows.
struct PoolCase {
  Fp8Format format;
  KvDType dtype;
};

class Fp8PoolTest : public ::testing::TestWithParam<PoolCase> {};

TEST_P(Fp8PoolTest, AppendQuantizesAndGatherDequantizes) {
  KvGeometry g;
  g.num_layers = 3;
  g.num_pages = 4;
  g.page_size = 4;
  g.num_qo_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.dtype = GetParam().dtype;
  g.kv_fp8 = GetParam().format;
  ASSERT_EQ(g.KvElemBytes(), 1);
  ASSERT_EQ(g.KvRowBytes(), g.RowElems());
  std::vector<uint8_t> k_pool(g.PoolBytes(), 0), v_pool(g.PoolBytes(), 0);
  std::vector<float> k_scales(g.num_layers * g.num_kv_heads), v_scales(k_scales.size());
  for (size_t i = 0; i < k_scales.size(); ++i) {
    k_scales[i] = 0.01f * static_cast<float>(i + 3);
    v_scales[i] = 0.5f / static_cast<float>(i + 1);
  }
  std::mt19937_64 gen(3);
  std::normal_distribution<float> dist(0.f, 2.f);
  const std::vector<int64_t> slots = {5, 0, 15, 7};
  const int64_t n = static_cast<int64_t>(slots.size());
  std::vector<uint16_t> k(n * g.RowElems()), v(k.size());
  for (auto* rows : {&k, &v}) {
    for (uint16_t& x : *rows) x = FloatToHalf(g.dtype, dist(gen));
  }
  const int32_t layer = 2;
  AppendKvParams a;
  a.k_cache = k_pool.data();
  a.v_cache = v_pool.data();
  a.k = k.data();
  a.v = v.data();
  a.slots = slots.data();
  a.n = n;
  a.layer = layer;
  a.geo = g;
  a.k_scales = k_scales.data();
  a.v_scales = v_scales.data();
  AppendKvCpu(a);
  // Each stored byte is the encoding of value / scale of its head.
  const Format f = Format::Of(g.kv_fp8);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < g.RowElems(); ++c) {
      const int64_t head = c / g.head_dim;
      const int64_t at = (layer * g.SlotsPerLayer() + slots[i]) * g.RowElems() + c;
      const double kx = HalfToFloat(g.dtype, k[i * g.RowElems() + c]);
      const double vx = HalfToFloat(g.dtype, v[i * g.RowElems() + c]);
      ASSERT_EQ(k_pool[at], f.Encode(kx / k_scales[layer * g.num_kv_heads + head]));
      ASSERT_EQ(v_pool[at], f.Encode(vx / v_scales[layer * g.num_kv_heads + head]));
    }
  }
  // Nothing outside those rows changed.
  int64_t nonzero = 0;
  for (uint8_t b : k_pool) nonzero += b != 0;
  EXPECT_LE(nonzero, n * g.RowElems());

  GatherKvParams gp;
  gp.k_cache = k_pool.data();
  gp.v_cache = v_pool.data();
  gp.slots = slots.data();
  gp.n = n;
  gp.layer = layer;
  gp.geo = g;
  gp.k_scales = k_scales.data();
  gp.v_scales = v_scales.data();
  // Stored bytes.
  std::vector<uint8_t> k8(n * g.RowElems()), v8(k8.size());
  gp.k = k8.data();
  gp.v = v8.data();
  GatherKvCpu(gp);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = (layer * g.SlotsPerLayer() + slots[i]) * g.RowElems();
    ASSERT_EQ(std::memcmp(k8.data() + i * g.RowElems(), k_pool.data() + at, g.RowElems()), 0);
    ASSERT_EQ(std::memcmp(v8.data() + i * g.RowElems(), v_pool.data() + at, g.RowElems()), 0);
  }
  // Dequantized: FP8 value x scale in float32, rounded to the query dtype;
  // within the format's half step of the original.
  std::vector<uint16_t> k16(k.size()), v16(v.size());
  gp.k = k16.data();
  gp.v = v16.data();
  gp.dequantize = true;
  GatherKvCpu(gp);
  // Quantization moves a value by at most half a step: |x| 2^-(M+1) for a
  // normal, 2^(emin - M - 1) x scale for a subnormal; the 16-bit rounding
  // adds at most 2^-8 of it.
  const int emin = 2 - (1 << (f.exp_bits - 1));
  for (int64_t i = 0; i < n * g.RowElems(); ++i) {
    const int64_t head = (i % g.RowElems()) / g.head_dim;
    const float ks = k_scales[layer * g.num_kv_heads + head];
    const float vs = v_scales[layer * g.num_kv_heads + head];
    ASSERT_EQ(k16[i], FloatToHalf(g.dtype, Fp8ToFloat(g.kv_fp8, k8[i]) * ks));
    ASSERT_EQ(v16[i], FloatToHalf(g.dtype, Fp8ToFloat(g.kv_fp8, v8[i]) * vs));
    const double kx = HalfToFloat(g.dtype, k[i]);
    const double back = HalfToFloat(g.dtype, k16[i]);
    const double tol = std::fabs(kx) * (std::ldexp(1.0, -(f.man_bits + 1)) + std::ldexp(1.0, -8)) +
                       std::ldexp(1.0, emin - f.man_bits - 1) * ks * 1.01;
    EXPECT_LE(std::fabs(back - kx), tol) << i;
  }

  // FP8 rows are stored as they are.
  std::vector<uint8_t> raw_k(n * g.RowElems()), raw_v(raw_k.size());
  for (size_t i = 0; i < raw_k.size(); ++i) {
    raw_k[i] = static_cast<uint8_t>(i * 37 + 1);
    raw_v[i] = static_cast<uint8_t>(i * 11 + 3);
  }
  a.k = raw_k.data();
  a.v = raw_v.data();
  a.rows_fp8 = true;
  AppendKvCpu(a);
  gp.k = k8.data();
  gp.v = v8.data();
  gp.dequantize = false;
  GatherKvCpu(gp);
  EXPECT_EQ(k8, raw_k);
  EXPECT_EQ(v8, raw_v);
}

INSTANTIATE_TEST_SUITE_P(Pools, Fp8PoolTest,
                         ::testing::Values(PoolCase{Fp8Format::kE4m3, KvDType::kBf16},
                                           PoolCase{Fp8Format::kE4m3, KvDType::kFp16},
                                           PoolCase{Fp8Format::kE5m2, KvDType::kBf16},
                                           PoolCase{Fp8Format::kE5m2, KvDType::kFp16}),
                         [](const ::testing::TestParamInfo<PoolCase>& info) {
                           return std::string(info.param.format == Fp8Format::kE4m3 ? "E4m3"
                                                                                    : "E5m2") +
                                  (info.param.dtype == KvDType::kBf16 ? "Bf16" : "Fp16");
                         });

// The FP8-query kernel's rounding of query rows (sm90_fp8q), as the float64
// reference states it (reference::RoundQueryRowToE4m3: frexp, nearbyint)
// and as the kernel computes it (kernels/fp8.h's QFp8Exponent, the row's
// power of two from its largest finite |q|, then the one quantizer with
// scale 2^-e): the two agree bit for bit on rows of both 16-bit types and of
// every magnitude, with zeros, subnormals, ties, infinities and NaNs. A row
// of bf16 values at 2^-120 keeps fewer bits (e clamps at 100).
TEST(Fp8QueryRoundingTest, ReferenceMatchesTheKernelsDefinition) {
  std::mt19937_64 rng(777);
  int changed = 0, rows = 0;
  for (const KvDType dtype : {KvDType::kBf16, KvDType::kFp16}) {
    for (int round = 0; round < 400; ++round) {
      const int n = 128;
      std::vector<uint16_t> row(n);
      // Magnitudes 2^lo .. 2^hi, with special elements.
      const int lo = static_cast<int>(rng() % 60) - (dtype == KvDType::kBf16 ? 130 : 24);
      const int span = static_cast<int>(rng() % 20);
      for (int i = 0; i < n; ++i) {
        const int ex = lo + static_cast<int>(rng() % (span + 1));
        const double mant = 1.0 + static_cast<double>(rng() % 1024) / 1024.0;
        double x = std::ldexp(mant, ex) * ((rng() & 1) != 0 ? -1.0 : 1.0);
        if (dtype == KvDType::kFp16) x = std::max(-60000.0, std::min(60000.0, x));
        row[i] = FloatToHalf(dtype, static_cast<float>(x));
      }
      switch (round % 8) {
        case 1: row[rng() % n] = FloatToHalf(dtype, std::numeric_limits<float>::infinity()); break;
        case 2: row[rng() % n] = FloatToHalf(dtype, std::numeric_limits<float>::quiet_NaN()); break;
        case 3: std::fill(row.begin(), row.end(), FloatToHalf(dtype, 0.f)); row[0] = FloatToHalf(dtype, -0.f); break;
        case 4: row[rng() % n] = FloatToHalf(dtype, -0.f); break;
        default: break;
      }
      // The kernel's definition.
      float amax = 0.f;
      for (uint16_t b : row) {
        const float x = HalfToFloat(dtype, b);
        if (std::isfinite(x)) amax = std::max(amax, std::fabs(x));
      }
      const int e = QFp8Exponent(amax);
      std::vector<uint16_t> want(n);
      for (int i = 0; i < n; ++i) {
        const float x = HalfToFloat(dtype, row[i]);
        const float down = std::ldexp(1.f, -e);
        want[i] = FloatToHalf(dtype, Fp8ToFloat(Fp8Format::kE4m3, Fp8Quantize(Fp8Format::kE4m3, x, down)) * down);
      }
      std::vector<uint16_t> got = row;
      reference::RoundQueryRowToE4m3(dtype, got.data(), n);
      for (int i = 0; i < n; ++i) {
        const bool both_nan = std::isnan(HalfToFloat(dtype, got[i])) && std::isnan(HalfToFloat(dtype, want[i]));
        ASSERT_TRUE(got[i] == want[i] || both_nan)
            << (dtype == KvDType::kBf16 ? "bf16" : "fp16") << " round " << round << " element " << i << ": "
            << HalfToFloat(dtype, row[i]) << " -> " << HalfToFloat(dtype, got[i]) << ", want "
            << HalfToFloat(dtype, want[i]) << " (e " << e << ")";
        changed += got[i] != row[i];
      }
      ++rows;
    }
  }
  EXPECT_GT(changed, rows * 16);  // rounding to 3 mantissa bits moves most elements
  // Ties to even: 1 + 2^-4 lies halfway between 1 and 1 + 2^-3 (E4M3's step
  // at 1; the row's largest value 128 keeps e = 0 there).
  std::vector<uint16_t> tie = {FloatToHalf(KvDType::kBf16, 128.f), FloatToHalf(KvDType::kBf16, 1.0625f),
                               FloatToHalf(KvDType::kBf16, 1.1875f)};
  reference::RoundQueryRowToE4m3(KvDType::kBf16, tie.data(), 3);
  EXPECT_EQ(HalfToFloat(KvDType::kBf16, tie[1]), 1.f);
  EXPECT_EQ(HalfToFloat(KvDType::kBf16, tie[2]), 1.25f);
  // In float64 the rounding is exact where 16 bits are not: fp16's 65504
  // rounds to 65536 (e = -8: 255.875 to 256), and a row whose largest value
  // is 2^-10 keeps steps of 2^-26, below fp16's subnormals.
  std::vector<double> wide = {65504.0, 1.0};
  reference::RoundQueryRowToE4m3(wide.data(), 2);
  EXPECT_EQ(wide[0], 65536.0);
  EXPECT_EQ(wide[1], 1.0);  // 2^-8 scaled: twice E4M3's smallest subnormal
  std::vector<double> small = {std::ldexp(1.0, -10), std::ldexp(3.0, -26)};
  reference::RoundQueryRowToE4m3(small.data(), 2);
  EXPECT_EQ(small[1], std::ldexp(3.0, -26));
  EXPECT_EQ(QFp8Exponent(128.f), 0);
  EXPECT_EQ(QFp8Exponent(1.f), 7);
  EXPECT_EQ(QFp8Exponent(255.9f), 0);
  EXPECT_EQ(QFp8Exponent(256.f), -1);
  EXPECT_EQ(QFp8Exponent(0.f), 0);
  EXPECT_EQ(QFp8Exponent(std::ldexp(1.f, -120)), 100);
  EXPECT_EQ(QFp8Exponent(3.0e38f), -100);
}

}  // namespace
}  // namespace attnserve
