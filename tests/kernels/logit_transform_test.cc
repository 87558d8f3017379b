// LogitTransform (kernels/variant.h), the one statement of how every kernel
// family turns a dot product into a base-2 logit, at the ends of the
// server's bounds: |sm_scale| <= 1e30, an FP8 k_scale <= 1e8, soft-caps in
// [1e-30, 1e30], and the fp16 Q exponents of the FP8 prefill kernels.
#include <cfloat>
#include <cmath>

#include "gtest/gtest.h"
#include "kernels/math.h"
#include "kernels/variant.h"

namespace attnserve {
namespace {

struct Seq {
  float sm_scale = 0.125f;
  float soft_cap = 0.f;
};

LogitTransform Of(float sm_scale, bool positive, float k_scale = 1.f, float cap = 0.f) {
  return LogitTransform::Of(Seq{sm_scale, cap}, positive, k_scale);
}

// The largest scale times the largest K scale keeps its exact multiplier
// (no clamp), so that a row of tiny queries gets its true logits.
TEST(LogitTransform, LargestScalesKeepTheirMultiplier) {
  for (bool positive : {false, true}) {
    const LogitTransform t = Of(1e30f, positive, 1e8f);
    EXPECT_EQ(t.mul, (1e30f * 1e8f) * kLog2e);
    EXPECT_LT(t.mul, FLT_MAX);
    EXPECT_EQ(Of(-1e30f, positive, 1e8f).mul, (positive ? 1.f : -1.f) * t.mul);
  }
}

// Positive-scale transforms keep tiny scales as they are (the floor used to
// be 1e-30, which multiplied a scale of 1e-31 by ten) and only raise what
// is below float32's smallest normal, 0 included, to it: never 0, so that a
// masked key's -inf times the multiplier stays -inf.
TEST(LogitTransform, TinyScalesAreKeptAndNeverZero) {
  EXPECT_EQ(Of(1e-31f, true).mul, 1e-31f * kLog2e);
  EXPECT_EQ(Of(-1e-31f, true).mul, 1e-31f * kLog2e);
  EXPECT_EQ(Of(0.f, true).mul, kMinLogitMul);
  EXPECT_EQ(Of(1e-40f, true).mul, kMinLogitMul);
  EXPECT_EQ(Of(1e-30f, true, 1e-20f).mul, kMinLogitMul);
  // Without positive_scale the sign and the value are kept.
  EXPECT_EQ(Of(-1e-31f, false).mul, -1e-31f * kLog2e);
  EXPECT_EQ(Of(0.f, false).mul, 0.f);
  // -inf stays -inf through the raised multiplier.
  EXPECT_EQ(Of(0.f, true).Log2(-INFINITY), -INFINITY);
}

// The FP8 prefill kernels' rows carry 2^e in their fp16 Q (|e| <= 100): the
// multiplier times 2^-e underflowed to 0 for tiny queries at tiny scales.
TEST(LogitTransform, RowExponentsNeverUnderflowTheMultiplier) {
  const float two_m100 = std::ldexp(1.f, -100);
  const LogitTransform t = Of(1e-30f, true).TimesPow2(two_m100);
  EXPECT_EQ(t.mul, kMinLogitMul);
  EXPECT_EQ(Of(0.125f, true).TimesPow2(two_m100).mul, 0.125f * kLog2e * two_m100);
  EXPECT_EQ(Of(0.125f, true).TimesPow2(std::ldexp(1.f, 100)).mul, 0.125f * kLog2e * std::ldexp(1.f, 100));
  // Capped, the multiplier may reach 0: the tanh comes before the mask.
  const LogitTransform c = Of(1e-30f, true, 1.f, 1e30f).TimesPow2(two_m100);
  EXPECT_EQ(c.mul, 0.f);
  EXPECT_EQ(c.Log2(-INFINITY), -INFINITY);
  EXPECT_EQ(c.Log2(5.f), 0.f);
}

// Soft-caps keep the clamp at float32's largest value (a tiny cap).
TEST(LogitTransform, TinyCapsClampTheMultiplier) {
  EXPECT_EQ(Of(1e30f, true, 1.f, 1e-30f).mul, FLT_MAX);
  EXPECT_EQ(Of(-1e30f, false, 1.f, 1e-30f).mul, -FLT_MAX);
  EXPECT_EQ(Of(0.125f, true, 1.f, 50.f).mul, 0.125f / 50.f);
  EXPECT_EQ(Of(0.125f, true, 1.f, 50.f).cap, 50.f * kLog2e);
}

}  // namespace
}  // namespace attnserve
