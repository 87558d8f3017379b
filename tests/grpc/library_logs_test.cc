// LogLimiter: at most one line per cause per period, the dropped ones counted
// into the next line written.
#include "server/library_logs.h"

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(LogLimiterTest, OneLineASecondPerCauseWithTheDroppedCounted) {
  LogLimiter limiter(absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(100);
  int64_t dropped = -1;
  EXPECT_TRUE(limiter.Allow("a", t0, &dropped));
  EXPECT_EQ(dropped, 0);
  for (int i = 1; i <= 500; ++i) {
    EXPECT_FALSE(limiter.Allow("a", t0 + absl::Milliseconds(i), &dropped));
  }
  // Another cause has its own allowance.
  EXPECT_TRUE(limiter.Allow("b", t0 + absl::Milliseconds(10), &dropped));
  EXPECT_EQ(dropped, 0);
  EXPECT_TRUE(limiter.Allow("a", t0 + absl::Seconds(1), &dropped));
  EXPECT_EQ(dropped, 500);
  EXPECT_FALSE(limiter.Allow("a", t0 + absl::Milliseconds(1500), &dropped));
  EXPECT_TRUE(limiter.Allow("a", t0 + absl::Seconds(3), &dropped));
  EXPECT_EQ(dropped, 1);
}

}  // namespace
}  // namespace attnserve
