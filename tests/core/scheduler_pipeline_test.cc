// Scheduler pipelining and release: pins released before done, the next
// batch submitted while one runs, the queue-delay ceiling, KV jobs ordered
// with batches in flight, and freed pages scrubbed in every layer.
#include "server/core/scheduler.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <set>
#include <utility>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/metrics.h"
#include "tests/core/scheduler_test_util.h"

namespace attnserve {
namespace scheduler_test {
namespace {

TEST_F(SchedulerTest, PinsAreReleasedBeforeTheDoneCallback) {
  backend_.set_block_first(false);
  Start(SchedulerOptions{});
  auto pages = pages_.Allocate("alice", 2);
  ASSERT_TRUE(pages.ok());
  ASSERT_TRUE(pages_.PinOwned("alice", *pages, "kv_indices").ok());
  // The owner frees the pages while the request is in flight.
  ASSERT_TRUE(pages_.Free("alice", *pages).ok());
  EXPECT_EQ(pages_.FreeCount(), 14);
  absl::Notification done;
  int free_in_callback = -1;
  auto job = Prefill(0, 1);
  job->pinned = *pages;
  job->done = [&](absl::Status) {
    free_in_callback = pages_.FreeCount();
    done.Notify();
  };
  MustEnqueue(std::move(job));
  done.WaitForNotification();
  EXPECT_EQ(free_in_callback, 16);
}

// A job's on_success (the written-rows marks of its appends) runs while its
// pages are still pinned: a page its owner freed while the job ran is
// released only after it, so its marks cannot land on the page once it is
// scrubbed and given to another tenant.
TEST_F(SchedulerTest, OnSuccessRunsBeforeThePinsAreReleased) {
  backend_.set_block_first(false);
  Start(SchedulerOptions{});
  auto pages = pages_.Allocate("alice", 2);
  ASSERT_TRUE(pages.ok());
  ASSERT_TRUE(pages_.PinOwned("alice", *pages, "kv_indices").ok());
  ASSERT_TRUE(pages_.Free("alice", *pages).ok());
  absl::Notification done;
  int free_in_on_success = -1;
  auto job = Prefill(0, 1);
  job->pinned = *pages;
  job->on_success = [&] { free_in_on_success = pages_.FreeCount(); };
  job->done = [&](absl::Status) { done.Notify(); };
  MustEnqueue(std::move(job));
  done.WaitForNotification();
  EXPECT_EQ(free_in_on_success, 14) << "the pages were released before on_success ran";
  EXPECT_EQ(pages_.FreeCount(), 16);
}

// Pipelining (depth 2): while batch 0 runs, the next batch is submitted
// once its oldest request reaches the delay ceiling, without waiting for
// batch 0; a third waits for a free slot.
TEST_F(SchedulerTest, NextBatchIsSubmittedWhileTheCurrentOneRuns) {
  backend_.set_depth(2);
  SchedulerOptions options;
  options.max_queue_delay_us = 0;
  Start(options);
  MustEnqueue(Prefill(0, 1));
  backend_.WaitEntered();  // batch 0 is "on the device"
  MustEnqueue(Prefill(1, 1));
  ASSERT_TRUE(backend_.WaitSubmitted(2, absl::Seconds(30)))
      << "batch 1 was not submitted while batch 0 ran";
  EXPECT_EQ(backend_.completed(), 0);
  MustEnqueue(Prefill(2, 1));
  MustEnqueue(Prefill(3, 1));
  backend_.Release();
  log_.WaitFor(4);
  const std::vector<std::vector<int32_t>> want = {{0}, {1}, {2, 3}};
  EXPECT_EQ(backend_.batches(), want);
  for (int id = 0; id < 4; ++id) {
    EXPECT_EQ(log_.calls(id), 1);
    EXPECT_EQ(outputs_[id], id);
  }
}

// The delay is a ceiling: a batch held while the device is busy goes when
// its oldest request has waited max_queue_delay_us, even though the running
// batch has not finished.
TEST_F(SchedulerTest, HeldBatchGoesAtTheDelayCeiling) {
  backend_.set_depth(2);
  SchedulerOptions options;
  options.max_queue_delay_us = 20000;
  Start(options);
  MustEnqueue(Prefill(0, 1));
  backend_.WaitEntered();
  MustEnqueue(Prefill(1, 1));
  EXPECT_TRUE(backend_.WaitSubmitted(2, absl::Seconds(30)))
      << "the held batch never went although its delay ceiling passed";
  EXPECT_EQ(backend_.completed(), 0);
  backend_.Release();
  log_.WaitFor(2);
}

// Below the ceiling, requests that arrive while a batch runs gather into one
// batch that goes when the running batch finishes.
TEST_F(SchedulerTest, RequestsGatherWhileTheDeviceIsBusy) {
  backend_.set_depth(2);
  SchedulerOptions options;
  options.max_queue_delay_us = int64_t{3600} * 1000 * 1000;  // an hour: never reached
  Start(options);
  MustEnqueue(Prefill(0, 1));
  backend_.WaitEntered();
  for (int id = 1; id <= 5; ++id) MustEnqueue(Prefill(id, 1));
  backend_.Release();
  log_.WaitFor(6);
  const std::vector<std::vector<int32_t>> want = {{0}, {1, 2, 3, 4, 5}};
  EXPECT_EQ(backend_.batches(), want);
}

// An idle device never waits: with an hour-long ceiling a lone request
// still completes at once.
TEST_F(SchedulerTest, LoneRequestOnAnIdleDeviceGoesAtOnce) {
  backend_.set_depth(2);
  backend_.set_block_first(false);
  SchedulerOptions options;
  options.max_queue_delay_us = int64_t{3600} * 1000 * 1000;
  Start(options);
  MustEnqueue(Prefill(0, 1));
  EXPECT_TRUE(log_.WaitFor(1, absl::Seconds(30))) << "a lone request waited for the ceiling";
  MustEnqueue(Prefill(1, 1));
  EXPECT_TRUE(log_.WaitFor(2, absl::Seconds(30)));
}

// With the idle spin on, requests that arrive while the worker polls and
// after it went back to sleep both run, a KV job included, and Stop returns
// (within the spin window) while the worker polls an empty queue.
TEST_F(SchedulerTest, IdleSpinTakesRequestsAndStops) {
  backend_.set_depth(2);
  backend_.set_block_first(false);
  SchedulerOptions options;
  options.idle_spin_us = 20000;
  Start(options);
  MustEnqueue(Prefill(0, 1));
  EXPECT_TRUE(log_.WaitFor(1, absl::Seconds(30)));
  MustEnqueue(Prefill(1, 1));  // the worker is polling now
  EXPECT_TRUE(log_.WaitFor(2, absl::Seconds(30)));
  absl::SleepFor(absl::Milliseconds(50));  // past the window: asleep
  MustEnqueue(Prefill(2, 1));
  EXPECT_TRUE(log_.WaitFor(3, absl::Seconds(30)));
  MustEnqueue(KvJob(3, Job::Kind::kWriteKv));
  EXPECT_TRUE(log_.WaitFor(4, absl::Seconds(30)));
  const absl::Time stop_start = absl::Now();
  scheduler_->Stop();
  EXPECT_LT(absl::Now() - stop_start, absl::Seconds(10));
}

// KV jobs run only when no batch is in flight (the fake backend fails the
// test otherwise) and keep their queue order.
TEST_F(SchedulerTest, KvJobsWaitForBatchesInFlight) {
  backend_.set_depth(2);
  SchedulerOptions options;
  options.max_queue_delay_us = 0;
  Start(options);
  MustEnqueue(Prefill(0, 1));
  backend_.WaitEntered();
  MustEnqueue(KvJob(1, Job::Kind::kWriteKv));
  MustEnqueue(Prefill(2, 1));
  MustEnqueue(KvJob(3, Job::Kind::kReadKv));
  backend_.Release();
  log_.WaitFor(4);
  EXPECT_EQ(backend_.ops(), "PWPR");
}

// Freed pages are zeroed through the backend (every slot of every layer)
// before they rejoin the free list; the done callback runs
// once all of it is finished, and pages freed while pinned follow when the
// request holding them finishes.
TEST(SchedulerScrubTest, ReleasedPagesAreZeroedInEveryLayerThenFreed) {
  FakeBackend backend;
  backend.set_block_first(false);
  KvGeometry& g = backend.mutable_geometry();
  g.num_layers = 3;
  g.num_pages = 2000;
  g.page_size = 16;  // 2000 pages x 16 rows: several scrub jobs
  PageTable pages(g.num_pages, 0, /*scrub_freed=*/true);
  Metrics metrics;
  Scheduler scheduler(&backend, &pages, &metrics, SchedulerOptions{});

  auto mine = pages.Allocate("alice", g.num_pages);
  ASSERT_TRUE(mine.ok());
  const int32_t held = (*mine)[5];
  ASSERT_TRUE(pages.PinOwned("alice", {held}, "kv_indices").ok());
  ASSERT_TRUE(pages.Free("alice", *mine).ok());
  EXPECT_EQ(pages.FreeCount(), 0);
  absl::Notification scrubbed;
  scheduler.ScrubReleased([&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    scrubbed.Notify();
  });
  ASSERT_TRUE(scrubbed.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(pages.FreeCount(), g.num_pages - 1) << "the pinned page was freed, or others were not";
  {
    std::set<std::pair<int32_t, int64_t>> rows;
    for (const auto& w : backend.written()) {
      EXPECT_TRUE(w.zero) << "scrub wrote a non-zero row";
      rows.insert({w.layer, w.slot});
    }
    EXPECT_EQ(static_cast<int64_t>(rows.size()), int64_t{g.num_layers} * (g.num_pages - 1) * g.page_size);
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      for (int64_t j = 0; j < g.page_size; ++j) {
        EXPECT_EQ(rows.count({layer, int64_t{held} * g.page_size + j}), 0u) << "the pinned page was zeroed";
        EXPECT_EQ(rows.count({layer, int64_t{(*mine)[0]} * g.page_size + j}), 1u);
      }
    }
  }
  // The request holding the last page finishes: that page is zeroed and freed.
  absl::Notification done;
  auto job = std::make_unique<Job>();
  job->kind = Job::Kind::kPrefill;
  int32_t out = 0;
  job->task.o = &out;
  job->pinned = {held};
  job->tenant = "alice";
  job->done = [&](absl::Status) { done.Notify(); };
  ASSERT_TRUE(scheduler.Enqueue(job).ok());
  done.WaitForNotification();
  scheduler.Stop();  // runs every queued job first, the page's scrub included
  EXPECT_EQ(pages.FreeCount(), g.num_pages);
  int held_rows = 0;
  for (const auto& w : backend.written()) held_rows += w.slot / g.page_size == held;
  EXPECT_EQ(held_rows, g.num_layers * g.page_size);
}

// Two FreePages at once: the first call's scrub took both calls' pages (it
// takes every released page), so the second found nothing to do and
// answered at once, while its pages were still being zeroed (an
// AllocatePages right after it then found them missing). A call now answers
// only once every scrub queued before it has finished.
TEST(SchedulerScrubTest, ACallWhosePagesAConcurrentCallTookWaitsForThem) {
  FakeBackend backend;
  backend.set_block_first(false);
  absl::Notification gate;
  backend.set_zero_gate(&gate);
  KvGeometry& g = backend.mutable_geometry();
  g.num_pages = 8;
  PageTable pages(g.num_pages, 0, /*scrub_freed=*/true);
  Metrics metrics;
  Scheduler scheduler(&backend, &pages, &metrics, SchedulerOptions{});
  auto a = pages.Allocate("alice", 4);
  auto b = pages.Allocate("bob", 4);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(pages.Free("alice", *a).ok());
  ASSERT_TRUE(pages.Free("bob", *b).ok());  // released before alice's call takes them
  absl::Notification alice_done, bob_done;
  scheduler.ScrubReleased([&](absl::Status) { alice_done.Notify(); });  // takes all 8
  scheduler.ScrubReleased([&](absl::Status) { bob_done.Notify(); });    // nothing left to take
  EXPECT_FALSE(bob_done.WaitForNotificationWithTimeout(absl::Milliseconds(200)))
      << "answered while its pages were still being zeroed";
  EXPECT_EQ(pages.FreeCount(), 0);
  gate.Notify();
  ASSERT_TRUE(alice_done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_TRUE(bob_done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(pages.FreeCount(), g.num_pages);
  // With nothing queued, a call answers at once.
  absl::Notification idle;
  scheduler.ScrubReleased([&](absl::Status) { idle.Notify(); });
  EXPECT_TRUE(idle.HasBeenNotified());
  scheduler.Stop();
}

}  // namespace
}  // namespace scheduler_test
}  // namespace attnserve
