#include "server/grpc/read_sweeper.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(ReadSweeper, TickFor) {
  EXPECT_EQ(ReadSweeper::TickFor(absl::Seconds(60), absl::Milliseconds(100)), absl::Milliseconds(100));
  EXPECT_EQ(ReadSweeper::TickFor(absl::Milliseconds(250), absl::Milliseconds(50)), absl::Milliseconds(25));
  EXPECT_EQ(ReadSweeper::TickFor(absl::Microseconds(5), absl::Milliseconds(50)), absl::Milliseconds(1));
}

// Sweeps every tick while the sweep says a call reads, then sleeps until
// Wake(); the destructor stops it without another sweep.
TEST(ReadSweeper, SleepsWhileNoCallReadsAndWakes) {
  std::atomic<int> sweeps{0};
  std::atomic<bool> reading{true};
  absl::Notification five;
  {
    ReadSweeper sweeper(absl::Milliseconds(1), [&](absl::Time) {
      if (sweeps.fetch_add(1) + 1 == 5) five.Notify();
      return reading.load();
    });
    ASSERT_TRUE(five.WaitForNotificationWithTimeout(absl::Seconds(30)));
    reading = false;
    // At most one sweep more still sees `reading`; after that it sleeps.
    absl::SleepFor(absl::Milliseconds(50));
    const int asleep = sweeps.load();
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_EQ(sweeps.load(), asleep) << "swept while no call reads";
    reading = true;
    sweeper.Wake();
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (sweeps.load() < asleep + 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    EXPECT_GE(sweeps.load(), asleep + 3) << "Wake() did not resume the sweeps";
  }
  const int stopped = sweeps.load();
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(sweeps.load(), stopped);
}

// A Wake() that comes while a sweep runs (after it has looked) is not lost.
TEST(ReadSweeper, AWakeDuringASweepIsKept) {
  std::atomic<int> sweeps{0};
  ReadSweeper* self = nullptr;
  absl::Notification ready, second;
  {
    ReadSweeper sweeper(absl::Milliseconds(1), [&](absl::Time) {
      ready.WaitForNotification();  // `self` is set
      const int n = sweeps.fetch_add(1) + 1;
      if (n == 1) self->Wake();  // the sweep then says no call reads
      if (n == 2) second.Notify();
      return false;
    });
    self = &sweeper;
    ready.Notify();
    EXPECT_TRUE(second.WaitForNotificationWithTimeout(absl::Seconds(30)));
  }
}

}  // namespace
}  // namespace attnserve
