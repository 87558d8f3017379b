// Scheduler batching: concurrent jobs queued behind a busy backend are served
// in fewer batches than jobs, within max_batch_tokens; queue order, a full
// queue (RESOURCE_EXHAUSTED), Stop and backend errors; every done callback
// runs exactly once.
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

TEST_F(SchedulerTest, ConcurrentJobsQueuedBehindABusyBackendShareBatches) {
  constexpr int kThreads = 8, kPerThread = 6;
  constexpr int kJobs = 1 + kThreads * kPerThread;
  Start(SchedulerOptions{});
  MustEnqueue(Prefill(0, 3));
  backend_.WaitEntered();  // the worker is inside batch 1; everything else queues
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) MustEnqueue(Prefill(1 + t * kPerThread + i, 1 + i));
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(log_.total(), 0) << "a job finished while the backend was blocked";
  backend_.Release();
  log_.WaitFor(kJobs);

  for (int id = 0; id < kJobs; ++id) {
    EXPECT_EQ(log_.calls(id), 1) << "job " << id;
    EXPECT_TRUE(log_.status(id).ok()) << "job " << id << ": " << log_.status(id);
    EXPECT_EQ(outputs_[id], id) << "job " << id << " got another job's output";
  }
  const auto batches = backend_.batches();
  EXPECT_LT(static_cast<int>(batches.size()), kJobs);
  // Everything queued behind batch 1 fits one batch of 16384 rows.
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_EQ(batches[0], std::vector<int32_t>{0});
  EXPECT_EQ(static_cast<int>(batches[1].size()), kJobs - 1);
  EXPECT_EQ(scheduler_->batches_run(), 2);
  // Each job was served exactly once across the batches.
  std::vector<int> served(kJobs, 0);
  for (const auto& b : batches) {
    for (int32_t id : b) ++served[id];
  }
  for (int id = 0; id < kJobs; ++id) EXPECT_EQ(served[id], 1) << "job " << id;
}

TEST_F(SchedulerTest, BatchesStayWithinMaxBatchTokensAndABigJobRunsAlone) {
  SchedulerOptions options;
  options.max_batch_tokens = 10;
  Start(options);
  MustEnqueue(Prefill(0, 1));
  backend_.WaitEntered();
  // 4 + 4 fit, 4 + 4 + 4 do not; 25 rows exceed the limit and run alone.
  MustEnqueue(Prefill(1, 4));
  MustEnqueue(Prefill(2, 4));
  MustEnqueue(Prefill(3, 4));
  MustEnqueue(Prefill(4, 25));
  MustEnqueue(Prefill(5, 6));
  MustEnqueue(Prefill(6, 4));
  backend_.Release();
  log_.WaitFor(7);
  const std::vector<std::vector<int32_t>> want = {{0}, {1, 2}, {3}, {4}, {5, 6}};
  EXPECT_EQ(backend_.batches(), want);
  for (const auto& rows : backend_.batch_rows()) {
    int32_t sum = 0;
    for (int32_t r : rows) sum += r;
    EXPECT_TRUE(sum <= 10 || rows.size() == 1) << "batch of " << sum << " rows";
  }
  for (int id = 0; id < 7; ++id) EXPECT_EQ(log_.calls(id), 1);
}

TEST_F(SchedulerTest, KvJobsKeepTheirPlaceInQueueOrder) {
  Start(SchedulerOptions{});
  MustEnqueue(Prefill(0, 1));
  backend_.WaitEntered();
  MustEnqueue(Prefill(1, 1));
  MustEnqueue(Prefill(2, 1));
  MustEnqueue(KvJob(3, Job::Kind::kWriteKv));
  MustEnqueue(Prefill(4, 1));
  MustEnqueue(KvJob(5, Job::Kind::kReadKv));
  MustEnqueue(Prefill(6, 1));
  MustEnqueue(Prefill(7, 1));
  backend_.Release();
  log_.WaitFor(8);
  EXPECT_EQ(backend_.ops(), "PPWPRP");
  const std::vector<std::vector<int32_t>> want = {{0}, {1, 2}, {4}, {6, 7}};
  EXPECT_EQ(backend_.batches(), want);
  for (int id = 0; id < 8; ++id) EXPECT_EQ(log_.calls(id), 1);
}

TEST_F(SchedulerTest, FullQueueIsResourceExhaustedAndKeepsTheJob) {
  SchedulerOptions options;
  options.max_queue_requests = 3;
  Start(options);
  MustEnqueue(Prefill(0, 1));
  backend_.WaitEntered();  // job 0 left the queue
  MustEnqueue(Prefill(1, 1));
  MustEnqueue(Prefill(2, 1));
  MustEnqueue(Prefill(3, 1));
  std::unique_ptr<Job> rejected = Prefill(4, 1);
  absl::Status s = scheduler_->Enqueue(rejected);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("max_queue_requests=3"), absl::string_view::npos) << s;
  ASSERT_NE(rejected, nullptr) << "a rejected job must stay with the caller";
  backend_.Release();
  log_.WaitFor(4);
  scheduler_->Stop();
  for (int id = 0; id < 4; ++id) EXPECT_EQ(log_.calls(id), 1);
  EXPECT_EQ(log_.calls(4), 0) << "the scheduler ran the done callback of a job it refused";
  // After Stop, Enqueue is UNAVAILABLE and the job stays with the caller.
  std::unique_ptr<Job> late = Prefill(5, 1);
  EXPECT_EQ(scheduler_->Enqueue(late).code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(late, nullptr);
}

// The memory queued and running jobs hold (Job::held_bytes) is bounded in
// all (max_queue_bytes) and per tenant (max_tenant_queue_bytes): past
// either a job is RESOURCE_EXHAUSTED and stays with the caller; a job of
// any size is taken when nothing (of its tenant) is held; finished jobs
// give their bytes back.
TEST_F(SchedulerTest, HeldBytesAreBoundedInAllAndPerTenant) {
  SchedulerOptions options;
  options.max_queue_bytes = 1000;
  options.max_tenant_queue_bytes = 600;
  Start(options);
  auto job = [&](int id, const char* tenant, int64_t bytes) {
    std::unique_ptr<Job> j = Prefill(id, 1);
    j->tenant = tenant;
    j->held_bytes = bytes;
    return j;
  };
  auto refused = [&](std::unique_ptr<Job> j, const std::string& why) {
    const absl::Status s = scheduler_->Enqueue(j);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find(why), absl::string_view::npos) << s;
    EXPECT_NE(j, nullptr) << "a refused job stays with the caller";
  };
  // Larger than both bounds, on an idle server: taken.
  MustEnqueue(job(0, "alice", 1500));
  backend_.WaitEntered();  // job 0 runs (blocked), holding 1500 bytes
  refused(job(1, "bob", 10), "hold 1500 bytes of server memory and this one would add 10, "
                             "max_queue_bytes=1000");
  EXPECT_EQ(scheduler_->held_bytes(), 1500);
  backend_.Release();
  log_.WaitFor(1);
  scheduler_->Stop();
  EXPECT_EQ(scheduler_->held_bytes(), 0) << "a finished job gives its bytes back";

  // Bob's 500 and 200 pass his 600; carol's 300 fits the total, her 200
  // more does not (900 + 200 > 1000); dave's first job is taken whatever
  // its size only when nothing at all is held.
  FakeBackend second;
  Scheduler s2(&second, &pages_, &metrics_, options);
  auto enqueue = [&](std::unique_ptr<Job> j) {
    const absl::Status st = s2.Enqueue(j);
    EXPECT_TRUE(st.ok()) << st;
  };
  auto refused2 = [&](std::unique_ptr<Job> j, const std::string& why) {
    const absl::Status st = s2.Enqueue(j);
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_NE(st.message().find(why), absl::string_view::npos) << st;
  };
  enqueue(job(10, "alice", 100));
  second.WaitEntered();
  enqueue(job(11, "bob", 500));
  refused2(job(12, "bob", 200), "its queued and running requests and unsent responses hold 500 bytes of server memory "
                                "and this one would add 200, max_tenant_queue_bytes=600");
  enqueue(job(13, "carol", 300));
  refused2(job(14, "carol", 200), "hold 900 bytes of server memory and this one would add 200, "
                                  "max_queue_bytes=1000");
  refused2(job(15, "dave", 2000), "max_queue_bytes=1000");
  enqueue(job(16, "carol", 0));  // holds nothing of the server's: never refused for bytes
  EXPECT_EQ(s2.held_bytes(), 900);
  second.Release();
  log_.WaitFor(5);
  s2.Stop();
  EXPECT_EQ(s2.held_bytes(), 0);
  for (int id : {0, 10, 11, 13, 16}) EXPECT_EQ(log_.calls(id), 1) << id;
  for (int id : {1, 12, 14, 15}) EXPECT_EQ(log_.calls(id), 0) << id;
}

// A caller that sends its next request as soon as it has the answer (from
// the done callback here) finds the finished request's bytes back: on an
// otherwise idle server its request is taken (before, the bytes were given
// back only after the callback, and it was RESOURCE_EXHAUSTED).
TEST_F(SchedulerTest, HeldBytesComeBackBeforeTheAnswer) {
  SchedulerOptions options;
  options.max_queue_bytes = 1000;
  Start(options);
  absl::Notification enqueued;
  absl::Status next_status = absl::UnknownError("not enqueued");
  std::unique_ptr<Job> first = Prefill(0, 1);
  first->held_bytes = 700;
  first->done = [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    std::unique_ptr<Job> next = Prefill(1, 1);
    next->held_bytes = 700;
    next->done = [](absl::Status) {};
    next_status = scheduler_->Enqueue(next);
    enqueued.Notify();
  };
  backend_.Release();  // nothing blocks
  MustEnqueue(std::move(first));
  ASSERT_TRUE(enqueued.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_TRUE(next_status.ok()) << next_status;
  scheduler_->Stop();
  EXPECT_EQ(scheduler_->held_bytes(), 0);
}

// A response the caller still holds after the answer (the gRPC edge, until
// the response is sent) keeps its bytes counted: the request's message
// bytes come back with the answer, the response's only with the release
// the caller was handed. Without hold_response they all come back.
TEST_F(SchedulerTest, HeldResponsesCountUntilTheirRelease) {
  SchedulerOptions options;
  options.max_queue_bytes = 1000;
  Start(options);
  backend_.Release();
  std::function<void()> release;
  absl::Notification answered;
  std::unique_ptr<Job> first = Prefill(0, 1);
  first->held_bytes = 700;
  first->response_bytes = 600;
  first->hold_response = [&](std::function<void()> r) {
    EXPECT_FALSE(answered.HasBeenNotified()) << "the hold comes before the answer";
    release = std::move(r);
  };
  first->done = [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    answered.Notify();
  };
  MustEnqueue(std::move(first));
  ASSERT_TRUE(answered.WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_TRUE(release);
  EXPECT_EQ(scheduler_->held_bytes(), 600) << "the message's 100 bytes are back, the response's are held";
  std::unique_ptr<Job> second = Prefill(1, 1);
  second->held_bytes = 500;
  const absl::Status refused = scheduler_->Enqueue(second);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("unsent responses hold 600 bytes"), absl::string_view::npos) << refused;
  release();
  EXPECT_EQ(scheduler_->held_bytes(), 0);
  absl::Notification second_done;
  second->done = [&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    second_done.Notify();
  };
  MustEnqueue(std::move(second));
  ASSERT_TRUE(second_done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  scheduler_->Stop();
  EXPECT_EQ(scheduler_->held_bytes(), 0) << "no hold_response: everything back with the answer";
}

// Internal work (zeroing freed pages) is not a request: it never fills the
// queue for the clients (before, a FreePages' scrub made a Prefill behind a
// running batch RESOURCE_EXHAUSTED at max_queue_requests=1).
TEST_F(SchedulerTest, PageScrubsDoNotCountAgainstTheQueueLimit) {
  PageTable scrubbing(16, 0, /*scrub_freed=*/true);
  SchedulerOptions options;
  options.max_queue_requests = 1;
  Scheduler scheduler(&backend_, &scrubbing, &metrics_, options);
  auto alices = [&](int id) {
    std::unique_ptr<Job> job = Prefill(id, 1);
    job->tenant = "alice";
    return job;
  };
  std::unique_ptr<Job> first = alices(0);
  ASSERT_TRUE(scheduler.Enqueue(first).ok());
  backend_.WaitEntered();  // job 0 runs (blocked): the queue is empty
  auto mine = scrubbing.Allocate("alice", 16);
  ASSERT_TRUE(mine.ok());
  ASSERT_TRUE(scrubbing.Free("alice", *mine).ok());
  absl::Notification scrubbed;
  scheduler.ScrubReleased([&](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    scrubbed.Notify();
  });
  std::unique_ptr<Job> second = alices(1);
  const absl::Status s = scheduler.Enqueue(second);
  EXPECT_TRUE(s.ok()) << s;
  std::unique_ptr<Job> third = alices(2);
  EXPECT_EQ(scheduler.Enqueue(third).code(), absl::StatusCode::kResourceExhausted)
      << "one request queued: the limit still holds";
  backend_.Release();
  log_.WaitFor(2);
  ASSERT_TRUE(scrubbed.WaitForNotificationWithTimeout(absl::Seconds(60)));
  scheduler.Stop();
  EXPECT_EQ(scrubbing.FreeCount(), 16);
}

TEST_F(SchedulerTest, StopFinishesEveryQueuedJob) {
  Start(SchedulerOptions{});
  MustEnqueue(Prefill(0, 1));
  backend_.WaitEntered();
  for (int id = 1; id < 20; ++id) MustEnqueue(Prefill(id, 2));
  MustEnqueue(KvJob(20, Job::Kind::kWriteKv));
  std::thread stopper([&] { scheduler_->Stop(); });
  backend_.Release();
  stopper.join();
  EXPECT_EQ(log_.total(), 21) << "Stop returned before draining the queue";
  for (int id = 0; id <= 20; ++id) {
    EXPECT_EQ(log_.calls(id), 1) << "job " << id;
    EXPECT_TRUE(log_.status(id).ok());
  }
  scheduler_->Stop();  // a second Stop is harmless
  EXPECT_EQ(log_.total(), 21);
}

TEST_F(SchedulerTest, BackendErrorReachesEveryJobOfTheBatch) {
  backend_.set_status(absl::InternalError("device lost"));
  Start(SchedulerOptions{});
  MustEnqueue(Prefill(0, 1));
  backend_.WaitEntered();
  MustEnqueue(Prefill(1, 1));
  MustEnqueue(Prefill(2, 1));
  backend_.Release();
  log_.WaitFor(3);
  for (int id = 0; id < 3; ++id) {
    EXPECT_EQ(log_.calls(id), 1);
    EXPECT_EQ(log_.status(id).code(), absl::StatusCode::kInternal);
  }
}

}  // namespace
}  // namespace scheduler_test
}  // namespace attnserve
