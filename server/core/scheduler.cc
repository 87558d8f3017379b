#include "server/core/scheduler.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/core/status_macros.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// The queue of the scheduler's own jobs (page scrubs); no tenant has an empty
// name (auth maps tokens to non-empty tenants, no auth uses "default").
constexpr char kInternalTenant[] = "";
// Rows per layer one scrub job zeroes: bounds how long it holds the device.
constexpr int64_t kScrubRowsPerJob = 16384;

}  // namespace

Scheduler::Scheduler(Backend* backend, PageTable* pages, Metrics* metrics,
                     SchedulerOptions options)
    : backend_(backend), pages_(pages), metrics_(metrics), options_(options) {
  worker_ = std::thread([this] { Loop(); });
  completer_ = std::thread([this] { CompleteLoop(); });
  const int finishers = std::clamp<int>(std::thread::hardware_concurrency() / 2, 1, 8);
  for (int i = 0; i < finishers; ++i) finishers_.emplace_back([this] { FinishLoop(); });
}

Scheduler::~Scheduler() { Stop(); }

absl::Status Scheduler::Enqueue(std::unique_ptr<Job>& job) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("server is shutting down");
  const int64_t requests = queued_ - queued_internal_;  // internal work is not a request
  if (requests >= options_.max_queue_requests) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full: ", requests, " requests queued, max_queue_requests=",
        options_.max_queue_requests));
  }
  std::deque<std::unique_ptr<Job>>& queue = QueueOf(job->tenant);
  const int64_t tenant_cap = options_.max_tenant_queue_requests > 0
                                 ? options_.max_tenant_queue_requests
                                 : options_.max_queue_requests;
  if (static_cast<int64_t>(queue.size()) >= tenant_cap) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full for this tenant: ", queue.size(),
        " requests queued, max_tenant_queue_requests=", tenant_cap));
  }
  if (job->held_bytes > 0) {
    // Past the budget a job waits for nothing: it is refused, and the
    // caller retries once memory is back.
    const int64_t tenant_cap =
        options_.max_tenant_queue_bytes > 0 ? options_.max_tenant_queue_bytes : options_.max_queue_bytes;
    ATTN_RETURN_IF_ERROR(held_->Take(job->tenant, job->held_bytes, options_.max_queue_bytes, tenant_cap));
  }
  Push(queue, std::move(job));
  return absl::OkStatus();
}

absl::Status HeldBytes::Take(const std::string& tenant, int64_t bytes, int64_t max_bytes,
                             int64_t tenant_max_bytes) {
  absl::MutexLock lock(&mu_);
  // The total first: that is the server's memory; then the tenant's share.
  if (total_ > 0 && total_ + bytes > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full: queued and running requests and unsent responses hold ", total_,
        " bytes of server memory and this one would add ", bytes, ", max_queue_bytes=", max_bytes));
  }
  auto it = tenant_.find(tenant);
  const int64_t held = it == tenant_.end() ? 0 : it->second;
  if (held > 0 && held + bytes > tenant_max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full for this tenant: its queued and running requests and unsent responses hold ", held,
        " bytes of server memory and this one would add ", bytes, ", max_tenant_queue_bytes=", tenant_max_bytes));
  }
  tenant_[tenant] += bytes;
  total_ += bytes;
  return absl::OkStatus();
}

void HeldBytes::Release(const std::string& tenant, int64_t bytes) {
  if (bytes <= 0) return;
  absl::MutexLock lock(&mu_);
  total_ -= bytes;
  auto it = tenant_.find(tenant);
  if (it != tenant_.end() && (it->second -= bytes) <= 0) tenant_.erase(it);
}

int64_t HeldBytes::total() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

std::deque<std::unique_ptr<Job>>& Scheduler::QueueOf(const std::string& tenant) {
  auto it = std::find_if(queues_.begin(), queues_.end(),
                         [&](const auto& q) { return q.first == tenant; });
  if (it != queues_.end()) return it->second;
  queues_.emplace_back(tenant, std::deque<std::unique_ptr<Job>>());
  return queues_.back().second;
}

void Scheduler::Push(std::deque<std::unique_ptr<Job>>& queue, std::unique_ptr<Job> job) {
  job->enqueued = absl::Now();
  if (job->kind == Job::Kind::kPrefill) queued_prefill_rows_ += job->task.total_q;
  if (job->kind == Job::Kind::kScrub) ++queued_internal_;
  queue.push_back(std::move(job));
  ++queued_;
  pushes_.fetch_add(1, std::memory_order_release);
  metrics_->SetQueueDepth(queued_ - queued_internal_);
}

bool Scheduler::CancelQueued(const std::string& tenant, uint64_t request_id, absl::Status why) {
  if (request_id == 0) return false;
  std::unique_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(queues_.begin(), queues_.end(),
                           [&](const auto& q) { return q.first == tenant; });
    if (it == queues_.end()) return false;
    std::deque<std::unique_ptr<Job>>& queue = it->second;
    auto pos = std::find_if(queue.begin(), queue.end(),
                            [&](const auto& j) { return j->request_id == request_id; });
    if (pos == queue.end()) return false;
    std::rotate(queue.begin(), pos, pos + 1);  // to the front, the rest in order
    job = PopFront(queue);
  }
  Finish(std::move(job), std::move(why));
  return true;
}

void Scheduler::Stop() {
  // Safe to call from several threads (signal-driven drain and main).
  absl::call_once(stop_once_, [this] {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    worker_.join();
    completer_.join();
    {
      absl::MutexLock lock(&finish_mu_);
      finish_stop_ = true;  // the finishers drain their queue, then exit
    }
    for (std::thread& t : finishers_) t.join();
  });
}

void Scheduler::ScrubReleased(DoneCallback done) {
  std::vector<int32_t> pages = pages_->TakeReleased();
  const int64_t page_size = backend_->Geometry().page_size;
  const size_t per_job = static_cast<size_t>(std::max<int64_t>(1, kScrubRowsPerJob / page_size));
  std::vector<std::unique_ptr<Job>> jobs;
  for (size_t begin = 0; begin < pages.size(); begin += per_job) {
    auto job = std::make_unique<Job>();
    job->kind = Job::Kind::kScrub;
    job->tenant = kInternalTenant;
    job->scrub.assign(pages.begin() + begin,
                      pages.begin() + std::min(pages.size(), begin + per_job));
    jobs.push_back(std::move(job));
  }
  // Each part counts itself out when it finishes, whatever order the parts
  // finish in; `done` waits for every part queued up to now, this call's
  // and earlier ones' (a concurrent call may have taken this caller's pages).
  bool done_now = false;
  {
    absl::MutexLock lock(&scrub_mu_);
    for (auto& job : jobs) {
      const uint64_t seq = scrub_next_++;
      scrub_outstanding_.insert(seq);
      job->done = [this, seq](absl::Status) { ScrubPartDone(seq); };
    }
    if (done && scrub_outstanding_.empty()) {
      done_now = true;
    } else if (done) {
      scrub_waiters_.emplace_back(scrub_next_, std::move(done));
    }
  }
  if (done_now) done(absl::OkStatus());
  if (jobs.empty()) return;
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      // Internal work is never refused for queue limits: a page left
      // unscrubbed would be lost to every tenant.
      std::deque<std::unique_ptr<Job>>& queue = QueueOf(kInternalTenant);
      for (auto& job : jobs) Push(queue, std::move(job));
      return;
    }
  }
  for (auto& job : jobs) job->done(absl::UnavailableError("server is shutting down"));
}

void Scheduler::ScrubPartDone(uint64_t seq) {
  std::vector<DoneCallback> ready;
  {
    absl::MutexLock lock(&scrub_mu_);
    scrub_outstanding_.erase(seq);
    // A waiter's parts are those numbered below its mark.
    const uint64_t first_open = scrub_outstanding_.empty() ? scrub_next_ : *scrub_outstanding_.begin();
    auto it = std::partition(scrub_waiters_.begin(), scrub_waiters_.end(),
                             [first_open](const auto& w) { return w.first > first_open; });
    for (auto w = it; w != scrub_waiters_.end(); ++w) ready.push_back(std::move(w->second));
    scrub_waiters_.erase(it, scrub_waiters_.end());
  }
  for (DoneCallback& done : ready) done(absl::OkStatus());
}

void Scheduler::SetFaultHandler(std::function<void(const absl::Status&)> handler) {
  absl::MutexLock lock(&mu_);
  on_fault_ = std::move(handler);
}

int64_t Scheduler::batches_run() const {
  absl::MutexLock lock(&mu_);
  return batches_run_;
}

std::unique_ptr<Job> Scheduler::PopFront(std::deque<std::unique_ptr<Job>>& queue) {
  std::unique_ptr<Job> job = std::move(queue.front());
  queue.pop_front();
  --queued_;
  if (job->kind == Job::Kind::kScrub) --queued_internal_;
  metrics_->SetQueueDepth(queued_ - queued_internal_);
  if (job->kind == Job::Kind::kPrefill) queued_prefill_rows_ -= job->task.total_q;
  return job;
}

void Scheduler::DropStale(std::deque<std::unique_ptr<Job>>& queue,
                          std::vector<std::unique_ptr<Job>>& dropped) {
  const absl::Time now = absl::Now();
  while (!queue.empty()) {
    Job& job = *queue.front();
    if (job.deadline > now && !(job.is_cancelled && job.is_cancelled())) return;
    dropped.push_back(PopFront(queue));
  }
}

const Job* Scheduler::NextJob() const {
  const size_t n = queues_.size();
  for (size_t i = 0; i < n; ++i) {
    const auto& queue = queues_[(next_tenant_ + i) % n].second;
    if (!queue.empty()) return queue.front().get();
  }
  return nullptr;
}

absl::Time Scheduler::OldestEnqueued() const {
  absl::Time oldest = absl::InfiniteFuture();
  for (const auto& [tenant, queue] : queues_) {
    if (!queue.empty()) oldest = std::min(oldest, queue.front()->enqueued);
  }
  return oldest;
}

bool Scheduler::WorkerReady() const {
  if (stopping_ && queued_ == 0) return true;  // drained: exit
  const Job* next = NextJob();
  if (next == nullptr) return false;
  // Other jobs run alone on an idle backend, in queue order.
  if (next->kind != Job::Kind::kPrefill) return busy_ == 0;
  if (busy_ >= backend_->PipelineDepth()) return false;
  if (busy_ == 0 || stopping_) return true;  // idle device: go at once
  if (queued_prefill_rows_ >= options_.max_batch_tokens) return true;
  return absl::Now() >= OldestEnqueued() + absl::Microseconds(options_.max_queue_delay_us);
}

void Scheduler::SpinForWork() {
  const int64_t seen = pushes_.load(std::memory_order_acquire);
  mu_.Unlock();
  const absl::Time until = absl::Now() + absl::Microseconds(options_.idle_spin_us);
  while (pushes_.load(std::memory_order_acquire) == seen && absl::Now() < until) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  mu_.Lock();
}

std::vector<std::unique_ptr<Job>> Scheduler::TakeWork(
    std::vector<std::unique_ptr<Job>>& dropped) {
  std::vector<std::unique_ptr<Job>> work;
  for (auto& [tenant, queue] : queues_) DropStale(queue, dropped);
  const size_t n = queues_.size();
  // The first non-empty queue from the cursor decides what runs next.
  size_t first = n;
  for (size_t i = 0; i < n; ++i) {
    const size_t t = (next_tenant_ + i) % n;
    if (!queues_[t].second.empty()) {
      first = t;
      break;
    }
  }
  if (first == n) return work;
  next_tenant_ = (first + 1) % n;
  if (queues_[first].second.front()->kind != Job::Kind::kPrefill) {
    work.push_back(PopFront(queues_[first].second));
    return work;
  }
  // Round-robin: each tenant adds its next prefill per turn while it fits.
  // A tenant whose next job is not a prefill sits the batch out, so its
  // requests keep their order.
  int64_t rows = 0, indices = 0, appends = 0;
  for (bool added = true; added;) {
    added = false;
    for (size_t i = 0; i < n; ++i) {
      const size_t t = (first + i) % n;
      auto& queue = queues_[t].second;
      if (queue.empty() || queue.front()->kind != Job::Kind::kPrefill) continue;
      const PrefillTask& next = queue.front()->task;
      const bool fits = rows + next.total_q <= options_.max_batch_tokens &&
                        indices + next.num_kv_indices <= options_.max_batch_kv_indices &&
                        appends + next.num_append <= options_.max_batch_append_rows;
      if (!fits && !work.empty()) continue;  // a job larger than the limits runs alone
      rows += next.total_q;
      indices += next.num_kv_indices;
      appends += next.num_append;
      work.push_back(PopFront(queue));
      added = true;
      if (!fits) return work;
    }
  }
  return work;
}

void Scheduler::Loop() {
  for (;;) {
    std::vector<std::unique_ptr<Job>> work, dropped;
    {
      absl::MutexLock lock(&mu_);
      for (;;) {
        // A batch held for more requests waits until the delay ceiling of
        // its oldest request; a newly queued job recomputes that ceiling.
        absl::Time deadline = absl::InfiniteFuture();
        if (busy_ > 0 && queued_ > 0) {
          deadline = OldestEnqueued() + absl::Microseconds(options_.max_queue_delay_us);
        }
        if (queued_ == 0 && !stopping_ && options_.idle_spin_us > 0) {
          SpinForWork();
          if (WorkerReady()) break;
        }
        const int64_t queued_before = queued_;
        auto wake = [this, queued_before]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return WorkerReady() || queued_ != queued_before;
        };
        mu_.AwaitWithDeadline(absl::Condition(&wake), deadline);
        if (WorkerReady()) break;
      }
      if (stopping_ && queued_ == 0) {
        worker_done_ = true;  // the completer finishes what is in flight
        return;
      }
      work = TakeWork(dropped);
      if (!work.empty() && work[0]->kind == Job::Kind::kPrefill) {
        ++batches_run_;
        ++busy_;  // reserved before Submit, so the rule sees it at once
      }
    }
    for (auto& job : dropped) {
      const bool cancelled = job->is_cancelled && job->is_cancelled();
      Finish(std::move(job), cancelled
                                 ? absl::CancelledError("request cancelled before launch")
                                 : absl::DeadlineExceededError(
                                       "deadline passed while the request was queued"));
    }
    if (work.empty()) continue;
    const absl::Time start = absl::Now();
    for (const auto& job : work) {
      if (job->kind == Job::Kind::kScrub) continue;  // page scrubs: not a client's wait
      metrics_->ObserveQueueWait(absl::ToDoubleSeconds(start - job->enqueued));
    }
    if (work[0]->kind == Job::Kind::kPrefill) {
      SubmitBatch(work);
    } else {
      RunJob(std::move(work[0]));
    }
  }
}

void Scheduler::SubmitBatch(std::vector<std::unique_ptr<Job>>& work) {
  InFlight batch;
  // The tasks move out of their jobs: nothing reads a job's task after this,
  // and their pointers (into the requests) stay valid until Finish.
  submit_tasks_.clear();
  for (auto& job : work) {
    batch.rows += job->task.total_q;
    job->task.given_up = job->is_cancelled;
    submit_tasks_.push_back(std::move(job->task));
  }
  const absl::Status status = backend_->Submit(submit_tasks_, &batch.stats);
  if (!status.ok()) {
    {
      absl::MutexLock lock(&mu_);
      --busy_;
    }
    ReportFault(status);
    for (auto& job : work) Finish(std::move(job), status);
    return;
  }
  batch.jobs = std::move(work);
  absl::MutexLock lock(&mu_);
  in_flight_.push_back(std::move(batch));
}

void Scheduler::CompleteLoop() {
  for (;;) {
    InFlight batch;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !in_flight_.empty() || (worker_done_ && busy_ == 0);
      };
      mu_.Await(absl::Condition(&ready));
      if (in_flight_.empty()) return;  // the worker has exited and all is done
      batch = std::move(in_flight_.front());
      in_flight_.pop_front();
    }
    const absl::Status status = backend_->Complete(&batch.stats);
    metrics_->ObserveBatch(static_cast<int>(batch.jobs.size()), batch.rows);
    ObserveStats(batch.stats);
    ReportFault(status);
    const absl::Time finish_start = absl::Now();
    if (batch.jobs.size() > 1) {
      absl::MutexLock lock(&finish_mu_);
      for (size_t i = 1; i < batch.jobs.size(); ++i) {
        finish_queue_.emplace_back(std::move(batch.jobs[i]), status);
      }
    }
    Finish(std::move(batch.jobs[0]), status);
    metrics_->ObserveStage(Metrics::Stage::kFinish, absl::ToDoubleSeconds(absl::Now() - finish_start));
    absl::MutexLock lock(&mu_);
    --busy_;
  }
}

void Scheduler::FinishLoop() {
  for (;;) {
    std::pair<std::unique_ptr<Job>, absl::Status> item;
    {
      absl::MutexLock lock(&finish_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(finish_mu_) {
        return finish_stop_ || !finish_queue_.empty();
      };
      finish_mu_.Await(absl::Condition(&ready));
      if (finish_queue_.empty()) return;  // stopping and drained
      item = std::move(finish_queue_.front());
      finish_queue_.pop_front();
    }
    Finish(std::move(item.first), item.second);
  }
}

void Scheduler::RunJob(std::unique_ptr<Job> job) {
  BatchStats stats;
  absl::Status status;
  switch (job->kind) {
    case Job::Kind::kWriteKv:
      status = backend_->WriteKv(job->rows, &stats);
      break;
    case Job::Kind::kReadKv:
      status = backend_->ReadKv(job->rows, &stats);
      break;
    case Job::Kind::kMerge: {
      // One `merge` launch, timed here: its wall time (the backend merges
      // on the host, or on the device and waits for it).
      const absl::Time start = absl::Now();
      status = backend_->MergeStates(job->merge, job->merge_on_device);
      if (status.ok() && job->merge.n > 0) {
        stats.merge_launches = 1;
        stats.merge_seconds = absl::ToDoubleSeconds(absl::Now() - start);
      }
      break;
    }
    case Job::Kind::kScrub:
      status = backend_->ZeroPages(job->scrub, &stats);
      if (status.ok()) {
        pages_->FinishScrub(job->scrub);
        const int32_t free_pages = pages_->FreeCount();
        metrics_->SetKvPages(free_pages, pages_->num_pages() - free_pages);
      } else {
        // The pages stay out of the free list: handing them out unzeroed
        // would leak their previous owner's KV.
        spdlog::error("zeroing {} freed pages failed, they stay unavailable: {}",
                      job->scrub.size(), status.ToString());
      }
      break;
    case Job::Kind::kRun:
      status = job->run(backend_);
      break;
    case Job::Kind::kPrefill:
      status = absl::InternalError("a prefill job reached RunJob");
      break;
  }
  ObserveStats(stats);
  ReportFault(status);
  Finish(std::move(job), status);
}

void Scheduler::ObserveStats(const BatchStats& stats) {
  // The batch's attention splits into the decode family's launch and the
  // rest (the prefill family's, or the CPU backend's): disjoint label values.
  // An MLA server's attention is all the MLA family's.
  const bool mla = backend_->Geometry().attention == AttentionKind::kMla;
  metrics_->ObserveKernel(mla ? Metrics::Kernel::kAttentionMla : Metrics::Kernel::kAttentionPrefill,
                          stats.attention_launches - stats.attention_decode_launches,
                          std::max(0.0, stats.attention_seconds - stats.attention_decode_seconds));
  metrics_->ObserveKernel(Metrics::Kernel::kAttentionDecode, stats.attention_decode_launches,
                          stats.attention_decode_seconds);
  metrics_->ObserveKernel(Metrics::Kernel::kMerge, stats.merge_launches, stats.merge_seconds);
  metrics_->ObserveKernel(Metrics::Kernel::kAppend, stats.append_launches, stats.append_seconds);
  metrics_->ObserveKernel(Metrics::Kernel::kKvRows, stats.kv_rows_launches, stats.kv_rows_seconds);
  metrics_->ObserveKernel(Metrics::Kernel::kZeroPages, stats.zero_launches, stats.zero_seconds);
  metrics_->AddGivenUp(stats.given_up_tasks);
  if (stats.attention_launches > 0 || stats.submit_seconds > 0) {
    metrics_->ObserveStage(Metrics::Stage::kSubmit, stats.submit_seconds);
    metrics_->ObserveStage(Metrics::Stage::kWait, stats.wait_seconds);
    metrics_->ObserveStage(Metrics::Stage::kUnpack, stats.unpack_seconds);
  }
}

void Scheduler::ReportFault(const absl::Status& status) {
  if (!(absl::IsInternal(status) || absl::IsUnknown(status) || absl::IsDataLoss(status))) return;
  std::function<void(const absl::Status&)> on_fault;
  {
    absl::MutexLock lock(&mu_);
    on_fault = on_fault_;
  }
  if (on_fault) on_fault(status);
}

int64_t Scheduler::held_bytes() const { return held_->total(); }

void Scheduler::Finish(std::unique_ptr<Job> job, const absl::Status& status) {
  // While the job pins its pages, none of them can have another owner.
  if (status.ok() && job->on_success) job->on_success();
  if (!job->pinned.empty()) {
    // Pages freed while this job was in flight are released now.
    if (pages_->Unpin(job->pinned)) ScrubReleased(nullptr);
    const int32_t free_pages = pages_->FreeCount();
    metrics_->SetKvPages(free_pages, pages_->num_pages() - free_pages);
  }
  // The message's bytes count as free from here: `done` answers the caller
  // (the message then goes with the call), and a caller that sends its next
  // request on the answer must find them back. The response's stay counted
  // until the caller's release where it holds the response on (the edge,
  // until gRPC has sent it: a client that reads no responses must not hold
  // more than max_queue_bytes of them).
  if (job->held_bytes > 0) {
    const int64_t kept = job->hold_response ? std::min(job->response_bytes, job->held_bytes) : 0;
    held_->Release(job->tenant, job->held_bytes - kept);
    if (kept > 0) {
      job->hold_response([held = held_, tenant = job->tenant, kept] { held->Release(tenant, kept); });
    }
  }
  DoneCallback done = std::move(job->done);
  job.reset();
  done(status);
}

}  // namespace attnserve
