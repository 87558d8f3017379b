// Scheduler: concurrent jobs queued behind a busy backend are served in
// fewer batches than jobs, within max_batch_tokens; every done callback runs
// exactly once; a full queue is RESOURCE_EXHAUSTED; pins are released.
//
// A fake Backend blocks in the Complete of its first batch (the device is
// "running" it) until the test releases it, so later jobs are known to be
// queued (no sleeps, no timing). Its pipeline depth is set per test.
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

namespace attnserve {
namespace {

// Records every call; the first Complete blocks until Release().
class FakeBackend final : public Backend {
 public:
  FakeBackend() {
    geo_.num_layers = 1;
    geo_.num_pages = 16;
    geo_.page_size = 1;
    geo_.num_qo_heads = 1;
    geo_.num_kv_heads = 1;
    geo_.head_dim = 64;
  }

  std::string Name() const override { return "fake"; }
  std::string Device() const override { return "fake"; }
  const KvGeometry& Geometry() const override { return geo_; }
  int PipelineDepth() const override { return depth_; }

  absl::Status Submit(absl::Span<const PrefillTask> tasks, BatchStats*) override {
    absl::MutexLock lock(&mu_);
    EXPECT_LT(static_cast<int>(pending_.size()), depth_) << "more batches in flight than the depth";
    std::vector<int32_t> ids, rows;
    std::vector<std::pair<int32_t*, int32_t>> outputs;
    for (const PrefillTask& t : tasks) {
      ids.push_back(t.layer);  // the test's job id
      rows.push_back(t.total_q);
      outputs.push_back({static_cast<int32_t*>(t.o), t.layer});
    }
    batches_.push_back(ids);
    batch_rows_.push_back(rows);
    pending_.push_back(outputs);
    ops_.push_back('P');
    return absl::OkStatus();
  }
  absl::Status Complete(BatchStats* stats) override {
    bool first;
    {
      absl::MutexLock lock(&mu_);
      first = !blocked_once_;
      blocked_once_ = true;
    }
    if (first && block_first_) {
      entered_.Notify();
      release_.WaitForNotification();
    }
    absl::MutexLock lock(&mu_);
    EXPECT_FALSE(pending_.empty()) << "Complete without a submitted batch";
    if (pending_.empty()) return absl::InternalError("nothing submitted");
    // Each job's own output: its id, so that results cannot be swapped.
    for (auto [o, id] : pending_.front()) *o = id;
    pending_.erase(pending_.begin());
    ++completed_;
    stats->attention_launches = 1;
    return status_;
  }
  absl::Status WriteKv(const KvRows& rows, BatchStats*) override {
    absl::MutexLock lock(&mu_);
    EXPECT_TRUE(pending_.empty()) << "WriteKv while a batch is in flight";
    ops_.push_back('W');
    // Rows written, as (layer, slot) with whether both K and V were zero.
    const int64_t row_bytes = geo_.RowElems() * 2;
    for (int64_t i = 0; i < rows.n; ++i) {
      bool zero = true;
      for (const void* src : {static_cast<const void*>(rows.k), static_cast<const void*>(rows.v)}) {
        if (src == nullptr) continue;
        const auto* b = static_cast<const uint8_t*>(src) + i * row_bytes;
        zero = zero && std::all_of(b, b + row_bytes, [](uint8_t x) { return x == 0; });
      }
      written_.push_back({rows.layer, rows.slots[i], zero});
    }
    return absl::OkStatus();
  }
  // Zeroing is recorded as writes of zero rows, every slot of every layer.
  absl::Status ZeroPages(absl::Span<const int32_t> pages, BatchStats*) override {
    absl::MutexLock lock(&mu_);
    EXPECT_TRUE(pending_.empty()) << "ZeroPages while a batch is in flight";
    for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
      for (int32_t page : pages) {
        for (int64_t j = 0; j < geo_.page_size; ++j) {
          written_.push_back({layer, int64_t{page} * geo_.page_size + j, true});
        }
      }
    }
    return absl::OkStatus();
  }
  struct Written {
    int32_t layer;
    int64_t slot;
    bool zero;
  };
  std::vector<Written> written() const {
    absl::MutexLock lock(&mu_);
    return written_;
  }
  KvGeometry& mutable_geometry() { return geo_; }
  absl::Status ReadKv(const KvRows&, BatchStats*) override {
    absl::MutexLock lock(&mu_);
    EXPECT_TRUE(pending_.empty()) << "ReadKv while a batch is in flight";
    ops_.push_back('R');
    return absl::OkStatus();
  }

  void set_depth(int depth) { depth_ = depth; }
  int submitted() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(batches_.size());
  }
  int completed() const {
    absl::MutexLock lock(&mu_);
    return completed_;
  }
  // Waits (at most `limit`) until `n` batches were submitted.
  bool WaitSubmitted(int n, absl::Duration limit) const {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return static_cast<int>(batches_.size()) >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), limit);
  }
  void set_block_first(bool b) { block_first_ = b; }
  void set_status(absl::Status s) { status_ = s; }
  void WaitEntered() { entered_.WaitForNotification(); }
  void Release() { release_.Notify(); }
  std::vector<std::vector<int32_t>> batches() const {
    absl::MutexLock lock(&mu_);
    return batches_;
  }
  std::vector<std::vector<int32_t>> batch_rows() const {
    absl::MutexLock lock(&mu_);
    return batch_rows_;
  }
  std::string ops() const {
    absl::MutexLock lock(&mu_);
    return ops_;
  }

 private:
  KvGeometry geo_;
  bool block_first_ = true;
  int depth_ = 1;
  absl::Status status_;
  absl::Notification entered_, release_;
  mutable absl::Mutex mu_;
  bool blocked_once_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::vector<int32_t>> batches_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<int32_t>> batch_rows_ ABSL_GUARDED_BY(mu_);
  std::string ops_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<std::pair<int32_t*, int32_t>>> pending_ ABSL_GUARDED_BY(mu_);
  int completed_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Written> written_ ABSL_GUARDED_BY(mu_);
};

// Counts done callbacks per job id and lets the test wait for all of them.
class DoneLog {
 public:
  explicit DoneLog(int jobs) : calls_(jobs, 0), statuses_(jobs) {}
  DoneCallback For(int id) {
    return [this, id](absl::Status s) {
      absl::MutexLock lock(&mu_);
      ++calls_[id];
      statuses_[id] = s;
      ++total_;
    };
  }
  void WaitFor(int total) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return total_ >= total; };
    mu_.Await(absl::Condition(&reached));
  }
  bool WaitFor(int total, absl::Duration limit) {
    absl::MutexLock lock(&mu_);
    auto reached = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return total_ >= total; };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), limit);
  }
  int calls(int id) {
    absl::MutexLock lock(&mu_);
    return calls_[id];
  }
  absl::Status status(int id) {
    absl::MutexLock lock(&mu_);
    return statuses_[id];
  }
  int total() {
    absl::MutexLock lock(&mu_);
    return total_;
  }

 private:
  absl::Mutex mu_;
  std::vector<int> calls_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  int total_ ABSL_GUARDED_BY(mu_) = 0;
};

class SchedulerTest : public ::testing::Test {
 protected:
  static constexpr int kMaxJobs = 256;

  SchedulerTest() : pages_(16, 0), outputs_(kMaxJobs, -1), log_(kMaxJobs) {}

  void Start(SchedulerOptions options) {
    scheduler_ = std::make_unique<Scheduler>(&backend_, &pages_, &metrics_, options);
  }

  std::unique_ptr<Job> Prefill(int id, int32_t rows) {
    auto job = std::make_unique<Job>();
    job->kind = Job::Kind::kPrefill;
    job->task.layer = id;
    job->task.total_q = rows;
    job->task.o = &outputs_[id];
    job->done = log_.For(id);
    return job;
  }
  std::unique_ptr<Job> KvJob(int id, Job::Kind kind) {
    auto job = std::make_unique<Job>();
    job->kind = kind;
    job->done = log_.For(id);
    return job;
  }
  void MustEnqueue(std::unique_ptr<Job> job) {
    absl::Status s = scheduler_->Enqueue(job);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(job, nullptr) << "Enqueue kept a job it accepted";
  }

  FakeBackend backend_;
  PageTable pages_;
  Metrics metrics_;
  std::vector<int32_t> outputs_;
  DoneLog log_;
  std::unique_ptr<Scheduler> scheduler_;
};

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

}  // namespace
}  // namespace attnserve
