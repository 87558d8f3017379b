#include "server/core/scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

Scheduler::Scheduler(Backend* backend, PageTable* pages, Metrics* metrics,
                     SchedulerOptions options)
    : backend_(backend), pages_(pages), metrics_(metrics), options_(options) {
  worker_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() { Stop(); }

absl::Status Scheduler::Enqueue(std::unique_ptr<Job>& job) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("server is shutting down");
  if (queued_ >= options_.max_queue_requests) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full: ", queued_, " requests queued, max_queue_requests=",
        options_.max_queue_requests));
  }
  auto it = std::find_if(queues_.begin(), queues_.end(),
                         [&](const auto& q) { return q.first == job->tenant; });
  if (it == queues_.end()) {
    queues_.emplace_back(job->tenant, std::deque<std::unique_ptr<Job>>());
    it = queues_.end() - 1;
  }
  const int64_t tenant_cap = options_.max_tenant_queue_requests > 0
                                 ? options_.max_tenant_queue_requests
                                 : options_.max_queue_requests;
  if (static_cast<int64_t>(it->second.size()) >= tenant_cap) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full for this tenant: ", it->second.size(),
        " requests queued, max_tenant_queue_requests=", tenant_cap));
  }
  job->enqueued = absl::Now();
  it->second.push_back(std::move(job));
  ++queued_;
  return absl::OkStatus();
}

void Scheduler::Stop() {
  // Safe to call from several threads (signal-driven drain and main).
  absl::call_once(stop_once_, [this] {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    worker_.join();
  });
}

void Scheduler::SetFaultHandler(std::function<void(const absl::Status&)> handler) {
  absl::MutexLock lock(&mu_);
  on_fault_ = std::move(handler);
}

int64_t Scheduler::batches_run() const {
  absl::MutexLock lock(&mu_);
  return batches_run_;
}

void Scheduler::DropStale(std::deque<std::unique_ptr<Job>>& queue,
                          std::vector<std::unique_ptr<Job>>& dropped) {
  const absl::Time now = absl::Now();
  while (!queue.empty()) {
    Job& job = *queue.front();
    if (job.deadline > now && !(job.is_cancelled && job.is_cancelled())) return;
    dropped.push_back(std::move(queue.front()));
    queue.pop_front();
    --queued_;
  }
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
  auto pop = [&](size_t t) {
    work.push_back(std::move(queues_[t].second.front()));
    queues_[t].second.pop_front();
    --queued_;
  };
  if (queues_[first].second.front()->kind != Job::Kind::kPrefill) {
    pop(first);
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
      pop(t);
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
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || queued_ > 0;
      };
      mu_.Await(absl::Condition(&ready));
      if (queued_ == 0) return;  // stopping and drained
      work = TakeWork(dropped);
      if (!work.empty() && work[0]->kind == Job::Kind::kPrefill) ++batches_run_;
    }
    for (auto& job : dropped) {
      const bool cancelled = job->is_cancelled && job->is_cancelled();
      Finish(std::move(job), cancelled
                                 ? absl::CancelledError("request cancelled before launch")
                                 : absl::DeadlineExceededError(
                                       "deadline passed while the request was queued"));
    }
    if (!work.empty()) Run(work);
  }
}

void Scheduler::Run(std::vector<std::unique_ptr<Job>>& work) {
  const absl::Time start = absl::Now();
  for (const auto& job : work) metrics_->ObserveQueueWait(absl::ToDoubleSeconds(start - job->enqueued));

  BatchStats stats;
  absl::Status status;
  Job& first = *work[0];
  switch (first.kind) {
    case Job::Kind::kPrefill: {
      std::vector<PrefillTask> tasks;
      tasks.reserve(work.size());
      int64_t rows = 0;
      for (const auto& job : work) {
        tasks.push_back(job->task);
        rows += job->task.total_q;
      }
      status = backend_->RunBatch(tasks, &stats);
      metrics_->ObserveBatch(static_cast<int>(work.size()), rows);
      break;
    }
    case Job::Kind::kWriteKv:
      status = backend_->WriteKv(first.rows, &stats);
      break;
    case Job::Kind::kReadKv:
      status = backend_->ReadKv(first.rows);
      break;
    case Job::Kind::kMerge:
      status = backend_->MergeStates(first.merge);
      break;
  }
  metrics_->ObserveKernel("attention", stats.attention_launches, stats.attention_seconds);
  metrics_->ObserveKernel("merge", stats.merge_launches, stats.merge_seconds);
  metrics_->ObserveKernel("append", stats.append_launches, stats.append_seconds);
  if (absl::IsInternal(status) || absl::IsUnknown(status) || absl::IsDataLoss(status)) {
    std::function<void(const absl::Status&)> on_fault;
    {
      absl::MutexLock lock(&mu_);
      on_fault = on_fault_;
    }
    if (on_fault) on_fault(status);
  }
  for (auto& job : work) Finish(std::move(job), status);
}

void Scheduler::Finish(std::unique_ptr<Job> job, const absl::Status& status) {
  if (!job->pinned.empty()) {
    pages_->Unpin(job->pinned);  // may release pages freed while in flight
    const int32_t free_pages = pages_->FreeCount();
    metrics_->SetKvPages(free_pages, pages_->num_pages() - free_pages);
  }
  DoneCallback done = std::move(job->done);
  job.reset();
  done(status);
}

}  // namespace attnserve
