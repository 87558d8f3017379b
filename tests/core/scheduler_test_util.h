// Shared pieces of the scheduler tests (scheduler_batching_test.cc,
// scheduler_pipeline_test.cc).
//
// A fake Backend blocks in the Complete of its first batch (the device is
// "running" it) until the test releases it, so later jobs are known to be
// queued (no sleeps, no timing). Its pipeline depth is set per test.
#pragma once

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
#include "server/core/scheduler.h"

namespace attnserve {
namespace scheduler_test {

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
  absl::Status SetKvScales(int32_t, absl::Span<const float>, absl::Span<const float>) override {
    absl::MutexLock lock(&mu_);
    EXPECT_TRUE(pending_.empty()) << "SetKvScales while a batch is in flight";
    ++scale_sets_;
    return absl::OkStatus();
  }
  int scale_sets() {
    absl::MutexLock lock(&mu_);
    return scale_sets_;
  }

  absl::Status ZeroPages(absl::Span<const int32_t> pages, BatchStats*) override {
    if (zero_gate_ != nullptr) zero_gate_->WaitForNotification();
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
  // ZeroPages waits for `gate` (set before the scheduler runs).
  void set_zero_gate(absl::Notification* gate) { zero_gate_ = gate; }
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
  absl::Notification* zero_gate_ = nullptr;
  int depth_ = 1;
  absl::Status status_;
  absl::Notification entered_, release_;
  mutable absl::Mutex mu_;
  int scale_sets_ ABSL_GUARDED_BY(mu_) = 0;
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

}  // namespace scheduler_test
}  // namespace attnserve
