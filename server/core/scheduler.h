// Scheduler: one queue, one worker thread that owns the backend.
//
// Each tenant has its own FIFO queue. Prefill jobs are drained into batches
// round-robin across tenants, one job per tenant per turn (up to
// max_batch_tokens query rows; a larger job runs alone), so one tenant's
// flood cannot hold the device; each batch goes to the backend in one call.
// WriteKV, ReadKV and MergeStates jobs run one at a time, in their tenant's
// queue order. A job whose deadline has passed or whose caller cancelled is
// dropped before launch (DEADLINE_EXCEEDED / CANCELLED). Every job's pinned
// pages are unpinned and its done callback runs after the backend returns.
//
// The backend runs batches synchronously on the worker, so the device is idle
// whenever a batch is formed: the worker never waits for more work once it
// has some, and batches grow under load from the requests that arrive while
// the previous batch runs. max_queue_delay_us is therefore a ceiling that the
// current worker never needs (kept for a pipelined backend).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <utility>
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
  std::string tenant;                  // fairness key
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> is_cancelled;  // may be empty
  DoneCallback done;
  absl::Time enqueued;
};

struct SchedulerOptions {
  int32_t max_batch_tokens = 16384;     // query rows per batch
  int64_t max_batch_kv_indices = 1 << 22;
  int64_t max_batch_append_rows = 65536;
  int64_t max_queue_delay_us = 0;
  int32_t max_queue_requests = 4096;    // queued jobs (all tenants) before RESOURCE_EXHAUSTED
  int32_t max_tenant_queue_requests = 0;  // queued jobs of one tenant; 0: max_queue_requests
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

  // Called (from the worker) when the backend fails with INTERNAL, UNKNOWN or
  // DATA_LOSS: the device may be unusable and health should say so.
  void SetFaultHandler(std::function<void(const absl::Status&)> handler);

  // Backend batches run so far (prefill batches only).
  int64_t batches_run() const;

 private:
  void Loop();
  // Takes the next unit of work off the queues (a prefill batch or one job),
  // and moves expired or cancelled jobs into `dropped`.
  std::vector<std::unique_ptr<Job>> TakeWork(std::vector<std::unique_ptr<Job>>& dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pops a tenant's expired or cancelled jobs off its front into `dropped`.
  void DropStale(std::deque<std::unique_ptr<Job>>& queue,
                 std::vector<std::unique_ptr<Job>>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(std::vector<std::unique_ptr<Job>>& work);
  void Finish(std::unique_ptr<Job> job, const absl::Status& status);

  Backend* const backend_;
  PageTable* const pages_;
  Metrics* const metrics_;
  const SchedulerOptions options_;

  mutable absl::Mutex mu_;
  // Per-tenant FIFO queues, visited round-robin from `next_tenant_`.
  std::deque<std::pair<std::string, std::deque<std::unique_ptr<Job>>>> queues_
      ABSL_GUARDED_BY(mu_);
  size_t next_tenant_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t batches_run_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void(const absl::Status&)> on_fault_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
  absl::once_flag stop_once_;
};

}  // namespace attnserve
