// Scheduler: per-tenant queues, a worker thread that owns the backend, a
// completion thread and finisher threads.
//
// Each tenant has its own FIFO queue. Prefill jobs are drained into batches
// round-robin across tenants, one job per tenant per turn (up to
// max_batch_tokens query rows; a larger job runs alone), so one tenant's
// flood cannot hold the device; each batch goes to the backend in one call.
// WriteKV, ReadKV, MergeStates and kRun jobs (SetKvScales) run one at a
// time, in their tenant's queue order. A job whose deadline has passed or whose caller cancelled is
// dropped before launch (DEADLINE_EXCEEDED / CANCELLED); a cancelled one
// leaves at once when the edge calls CancelQueued. Every job's pinned
// pages are unpinned and its done callback runs after the backend returns.
//
// Batches are pipelined (Backend::Submit / Complete): the worker thread forms
// and submits the next batch while up to Backend::PipelineDepth() earlier
// ones run, and a completion thread waits for each batch in order, writes
// its outputs and finishes its jobs. When the device is idle the next batch
// goes at once, however small; while a batch runs, the next one waits for
// more requests until the running batch finishes, the queued rows reach
// max_batch_tokens, or its oldest request has waited max_queue_delay_us,
// whichever comes first (a ceiling, never a fixed wait). WriteKV, ReadKV
// and MergeStates jobs run on the worker once every submitted batch has
// completed, so they are ordered with the batches around them.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/base/call_once.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"
#include "server/core/page_table.h"
#include "server/core/plan_table.h"
#include "server/core/requests.h"
#include "server/metrics.h"

namespace attnserve {

struct Job {
  enum class Kind { kPrefill, kWriteKv, kReadKv, kMerge, kScrub, kRun };
  Kind kind = Kind::kPrefill;
  // kRun: called on the worker with the backend, ordered as WriteKV jobs
  // are (no batch in flight); its status finishes the job.
  std::function<absl::Status(Backend*)> run;
  PrefillTask task;                    // kPrefill
  KvRows rows;                         // kWriteKv, kReadKv
  MergeStatesParams merge;             // kMerge (pointers into the two vectors below)
  std::vector<const void*> merge_v;
  std::vector<const float*> merge_lse;
  MergeOnDevice merge_on_device;       // kMerge: which of those are device memory
  std::vector<int32_t> pinned;         // pages unpinned when the job finishes
  std::shared_ptr<const Plan> plan;    // kPrefill naming a plan: its arrays and pins live on
  std::vector<int32_t> scrub;          // kScrub: released pages to zero, then free
  std::string tenant;                  // fairness key
  uint64_t request_id = 0;             // the edge's id (CancelQueued); 0 for internal jobs
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> is_cancelled;  // may be empty
  DoneCallback done;
  // Run by Finish when the job succeeded, before its pages are unpinned and
  // before `done` (WrittenRows::Marker); destroyed with the job.
  std::function<void()> on_success;
  absl::Time enqueued;
  // Server memory the request holds until it finishes: its message (inline
  // tensors included) and its response buffer (SchedulerOptions::
  // max_queue_bytes). 0 for internal jobs.
  int64_t held_bytes = 0;
  // Of held_bytes, the response's: with hold_response set, they stay
  // counted after the job finishes until the caller runs the release it is
  // handed (the edge: once gRPC has sent the response, or the call ended
  // without it), so that responses a client does not read stay within
  // max_queue_bytes. Finish calls hold_response before `done`.
  int64_t response_bytes = 0;
  std::function<void(std::function<void()> release)> hold_response;
};

// Job::held_bytes of the jobs queued or running, and of the responses not
// yet sent, in all and per tenant; shared with the releases Finish hands
// out (which may run after the scheduler is gone).
class HeldBytes {
 public:
  // Adds `bytes` for `tenant` unless that passes a bound (a tenant's or the
  // total, the total first; either is passed only when something of it is
  // held already): then RESOURCE_EXHAUSTED naming the flag.
  absl::Status Take(const std::string& tenant, int64_t bytes, int64_t max_bytes, int64_t tenant_max_bytes);
  void Release(const std::string& tenant, int64_t bytes);
  int64_t total() const;

 private:
  mutable absl::Mutex mu_;
  int64_t total_ ABSL_GUARDED_BY(mu_) = 0;
  // Entries of tenants that hold none are erased.
  absl::flat_hash_map<std::string, int64_t> tenant_ ABSL_GUARDED_BY(mu_);
};

struct SchedulerOptions {
  int32_t max_batch_tokens = 16384;     // query rows per batch
  int64_t max_batch_kv_indices = 1 << 22;
  int64_t max_batch_append_rows = 65536;
  int64_t max_queue_delay_us = 1000;    // ceiling on holding a batch while the device is busy
  int32_t max_queue_requests = 4096;    // queued jobs (all tenants) before RESOURCE_EXHAUSTED
  int32_t max_tenant_queue_requests = 0;  // queued jobs of one tenant; 0: max_queue_requests
  // Bytes of server memory queued and running jobs may hold (Job::
  // held_bytes): past either bound a new job is RESOURCE_EXHAUSTED, in all
  // and for one tenant (0: max_queue_bytes). A job is taken whatever its
  // size when nothing (of its tenant) is held, so a request within
  // max_message_bytes always runs on an otherwise idle server.
  int64_t max_queue_bytes = int64_t{8} << 30;
  int64_t max_tenant_queue_bytes = 0;
  // When its queue runs empty, the worker polls for the next job this long
  // before it sleeps: a request that arrives meanwhile is taken without a
  // thread wake-up (tens of microseconds on an idle host) at the cost of one
  // busy core while requests keep coming. 0: sleep at once.
  int64_t idle_spin_us = 0;
};

class Scheduler {
 public:
  Scheduler(Backend* backend, PageTable* pages, Metrics* metrics, SchedulerOptions options);
  ~Scheduler();

  // Queues a job. On success takes ownership (job becomes null); on error
  // (RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE after Stop) the
  // job stays with the caller.
  absl::Status Enqueue(std::unique_ptr<Job>& job);

  // Takes the tenant's queued job with this request id (non-zero) off the
  // queue and finishes it with `why` (CANCELLED, or DEADLINE_EXCEEDED when
  // its deadline passed): its pages are unpinned and its buffers released
  // now, not when the worker would have reached it. False when no such job
  // is queued (already running, finished or unknown).
  bool CancelQueued(const std::string& tenant, uint64_t request_id, absl::Status why);

  // Refuses new jobs, finishes every queued one, joins the worker.
  void Stop();

  // Queues the zeroing of every page the page table has released (freed and
  // unpinned) since the last call; each page rejoins the free list once its
  // KV rows are zero in every layer. The work goes in jobs of a bounded size
  // on an internal queue that takes its round-robin turn with the tenants,
  // so a large free cannot stall everyone else. `done` (may be null) runs
  // once all of it has finished, and every scrub queued before it (which
  // may hold pages this call's caller released: a concurrent call takes all
  // the released pages there are), OK also when there was nothing to do or
  // the scheduler is stopping (the pages then stay out of the free list).
  void ScrubReleased(DoneCallback done);

  // Called (from the worker) when the backend fails with INTERNAL, UNKNOWN or
  // DATA_LOSS: the device may be unusable and health should say so.
  void SetFaultHandler(std::function<void(const absl::Status&)> handler);

  // Backend batches run so far (prefill batches only).
  int64_t batches_run() const;

  // Job::held_bytes of the jobs queued or running, and the response bytes
  // still held (Job::hold_response).
  int64_t held_bytes() const;

 private:
  // A submitted batch awaiting Complete.
  struct InFlight {
    std::vector<std::unique_ptr<Job>> jobs;
    int64_t rows = 0;
    BatchStats stats;
  };

  void Loop();           // the worker: forms and submits batches, runs other jobs
  void CompleteLoop();   // the completion thread
  // True when the worker has something to do now: exit, a job to run, or a
  // batch to submit (see the header comment for the rule).
  bool WorkerReady() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job TakeWork would start with, or null when every queue is empty.
  const Job* NextJob() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // When the oldest queued job was enqueued (InfiniteFuture when none).
  absl::Time OldestEnqueued() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the next unit of work off the queues (a prefill batch or one job),
  // and moves expired or cancelled jobs into `dropped`.
  // The idle spin (SchedulerOptions::idle_spin_us): releases mu_, polls
  // pushes_ until a job is queued or the time is up, and takes mu_ again.
  void SpinForWork() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::unique_ptr<Job>> TakeWork(std::vector<std::unique_ptr<Job>>& dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pops a tenant's expired or cancelled jobs off its front into `dropped`.
  void DropStale(std::deque<std::unique_ptr<Job>>& queue,
                 std::vector<std::unique_ptr<Job>>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::unique_ptr<Job> PopFront(std::deque<std::unique_ptr<Job>>& queue)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tenant's queue, created empty on first use.
  std::deque<std::unique_ptr<Job>>& QueueOf(const std::string& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends a job to a queue and counts it (no limits checked).
  void Push(std::deque<std::unique_ptr<Job>>& queue, std::unique_ptr<Job> job)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SubmitBatch(std::vector<std::unique_ptr<Job>>& work);
  void RunJob(std::unique_ptr<Job> job);
  void ObserveStats(const BatchStats& stats);
  void ReportFault(const absl::Status& status);
  void Finish(std::unique_ptr<Job> job, const absl::Status& status);
  void FinishLoop();  // a finisher thread

  Backend* const backend_;
  PageTable* const pages_;
  Metrics* const metrics_;
  const SchedulerOptions options_;

  mutable absl::Mutex mu_;
  std::atomic<int64_t> pushes_{0};  // jobs ever queued: what the idle spin watches
  // Per-tenant FIFO queues, visited round-robin from `next_tenant_`.
  std::deque<std::pair<std::string, std::deque<std::unique_ptr<Job>>>> queues_
      ABSL_GUARDED_BY(mu_);
  size_t next_tenant_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;           // every job, internal ones too
  int64_t queued_internal_ ABSL_GUARDED_BY(mu_) = 0;  // page scrubs (not requests)
  int64_t queued_prefill_rows_ ABSL_GUARDED_BY(mu_) = 0;
  const std::shared_ptr<HeldBytes> held_ = std::make_shared<HeldBytes>();
  std::deque<InFlight> in_flight_ ABSL_GUARDED_BY(mu_);  // submitted, awaiting the completer
  int32_t busy_ ABSL_GUARDED_BY(mu_) = 0;  // submitted and not yet completed
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_done_ ABSL_GUARDED_BY(mu_) = false;
  int64_t batches_run_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void(const absl::Status&)> on_fault_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
  std::vector<PrefillTask> submit_tasks_;  // the worker's scratch for SubmitBatch
  std::thread completer_;
  // Jobs handed to the finisher threads, and whether they should exit once
  // the queue is empty.
  absl::Mutex finish_mu_;
  std::deque<std::pair<std::unique_ptr<Job>, absl::Status>> finish_queue_
      ABSL_GUARDED_BY(finish_mu_);
  bool finish_stop_ ABSL_GUARDED_BY(finish_mu_) = false;
  std::vector<std::thread> finishers_;
  absl::once_flag stop_once_;
  // Scrub parts queued and not yet finished, by a sequence number in queue
  // order, and the ScrubReleased callers waiting for every part up to theirs.
  void ScrubPartDone(uint64_t seq);
  absl::Mutex scrub_mu_;
  uint64_t scrub_next_ ABSL_GUARDED_BY(scrub_mu_) = 0;
  std::set<uint64_t> scrub_outstanding_ ABSL_GUARDED_BY(scrub_mu_);
  std::vector<std::pair<uint64_t, DoneCallback>> scrub_waiters_ ABSL_GUARDED_BY(scrub_mu_);
};

}  // namespace attnserve
