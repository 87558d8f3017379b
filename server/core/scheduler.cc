#include "server/core/scheduler.h"

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
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queue_requests) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue full: ", queue_.size(), " requests queued, max_queue_requests=",
        options_.max_queue_requests));
  }
  job->enqueued = absl::Now();
  queue_.push_back(std::move(job));
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

int64_t Scheduler::batches_run() const {
  absl::MutexLock lock(&mu_);
  return batches_run_;
}

std::vector<std::unique_ptr<Job>> Scheduler::TakeWork() {
  std::vector<std::unique_ptr<Job>> work;
  work.push_back(std::move(queue_.front()));
  queue_.pop_front();
  if (work[0]->kind != Job::Kind::kPrefill) return work;
  int64_t rows = work[0]->task.total_q;
  int64_t indices = work[0]->task.num_kv_indices;
  int64_t appends = work[0]->task.num_append;
  // Later prefills join in queue order while they fit; a non-prefill job
  // ends the batch so that requests keep their order around it.
  while (!queue_.empty() && queue_.front()->kind == Job::Kind::kPrefill) {
    const PrefillTask& next = queue_.front()->task;
    if (rows + next.total_q > options_.max_batch_tokens ||
        indices + next.num_kv_indices > options_.max_batch_kv_indices ||
        appends + next.num_append > options_.max_batch_append_rows) {
      break;
    }
    rows += next.total_q;
    indices += next.num_kv_indices;
    appends += next.num_append;
    work.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  return work;
}

void Scheduler::Loop() {
  for (;;) {
    std::vector<std::unique_ptr<Job>> work;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping and drained
      work = TakeWork();
      if (work[0]->kind == Job::Kind::kPrefill) ++batches_run_;
    }
    Run(work);
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
