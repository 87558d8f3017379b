#include "server/grpc/read_sweeper.h"

#include <algorithm>
#include <utility>

namespace attnserve {

ReadSweeper::ReadSweeper(absl::Duration tick, absl::AnyInvocable<bool(absl::Time)> sweep)
    : tick_(tick), sweep_(std::move(sweep)) {
  thread_ = std::thread([this] { Run(); });
}

ReadSweeper::~ReadSweeper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void ReadSweeper::Wake() {
  absl::MutexLock lock(&mu_);
  woken_ = true;
}

absl::Duration ReadSweeper::TickFor(absl::Duration timeout, absl::Duration longest) {
  return std::clamp(timeout / 10, absl::Milliseconds(1), longest);
}

void ReadSweeper::Run() {
  absl::MutexLock lock(&mu_);
  auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || woken_; };
  while (true) {
    // Asleep while no call reads (a Wake() since the last sweep counts).
    mu_.Await(absl::Condition(&wake));
    if (stop_ || mu_.AwaitWithTimeout(absl::Condition(&stop_), tick_)) break;
    woken_ = false;
    mu_.Unlock();
    const bool reading = sweep_(absl::Now());
    mu_.Lock();
    if (reading) woken_ = true;
  }
}

}  // namespace attnserve
