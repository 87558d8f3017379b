// Scheduler: one queue, one worker thread that owns the backend.
//
// Prefill jobs are drained into batches (up to max_batch_tokens query rows;
// a larger job runs alone) and each batch goes to the backend in one call.
// WriteKV, ReadKV and MergeStates jobs run one at a time, in queue order.
// Every job's pinned pages are unpinned and its done callback runs after the
// backend returns.
//
// The backend runs batches synchronously on the worker, so the device is idle
// whenever a batch is formed: the worker never waits for more work once it
// has some, and batches grow under load from the requests that arrive while
// the previous batch runs. max_queue_delay_us is therefore a ceiling that the
// current worker never needs (kept for a pipelined backend).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/base/call_once.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend.h"
#include "server/core/page_table.h"
#include "server/core/requests.h"
#include "server/metrics.h"

namespace attnserve {

struct Job {
  enum class Kind { kPrefill, kWriteKv, kReadKv, kMerge };
  Kind kind = Kind::kPrefill;
  PrefillTask task;                    // kPrefill
  KvRows rows;                         // kWriteKv, kReadKv
  MergeStatesParams merge;             // kMerge (pointers into the two vectors below)
  std::vector<const void*> merge_v;
  std::vector<const float*> merge_lse;
  std::vector<int32_t> pinned;         // pages unpinned when the job finishes
  DoneCallback done;
  absl::Time enqueued;
};

struct SchedulerOptions {
  int32_t max_batch_tokens = 16384;     // query rows per batch
  int64_t max_batch_kv_indices = 1 << 22;
  int64_t max_batch_append_rows = 65536;
  int64_t max_queue_delay_us = 0;
  int32_t max_queue_requests = 4096;    // queued jobs before RESOURCE_EXHAUSTED
};

class Scheduler {
 public:
  Scheduler(Backend* backend, PageTable* pages, Metrics* metrics, SchedulerOptions options);
  ~Scheduler();

  // Queues a job. On success takes ownership (job becomes null); on error
  // (RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE after Stop) the
  // job stays with the caller.
  absl::Status Enqueue(std::unique_ptr<Job>& job);

  // Refuses new jobs, finishes every queued one, joins the worker.
  void Stop();

  // Backend batches run so far (prefill batches only).
  int64_t batches_run() const;

 private:
  void Loop();
  // Takes the next unit of work off the queue (a prefill batch or one job).
  std::vector<std::unique_ptr<Job>> TakeWork() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(std::vector<std::unique_ptr<Job>>& work);
  void Finish(std::unique_ptr<Job> job, const absl::Status& status);

  Backend* const backend_;
  PageTable* const pages_;
  Metrics* const metrics_;
  const SchedulerOptions options_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t batches_run_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread worker_;
  absl::once_flag stop_once_;
};

}  // namespace attnserve
