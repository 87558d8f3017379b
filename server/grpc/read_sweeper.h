// The thread that keeps the read timeouts of a service's calls: every
// `tick` it calls `sweep(now)`, which finishes the calls whose request is
// overdue, rather than a timer per call (whose setting and cancelling
// would cost each request a completion-queue round and a thread hand-off).
// The attention service and the health service each own one.
#pragma once

#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

class ReadSweeper {
 public:
  // sweep(now) runs on the sweeper's thread with none of the sweeper's
  // locks held, and returns whether a call is still reading: while none
  // is, the thread sleeps until Wake().
  ReadSweeper(absl::Duration tick, absl::AnyInvocable<bool(absl::Time)> sweep);
  // Stops the thread (after the sweep under way, if any) and joins it.
  ~ReadSweeper();
  ReadSweeper(const ReadSweeper&) = delete;
  ReadSweeper& operator=(const ReadSweeper&) = delete;

  // A call has started reading: the thread ticks again.
  void Wake();

  // One look per tenth of `timeout`, at most every `longest` and at least
  // every millisecond: an overdue call is cut off within a tenth of the
  // timeout (or `longest`) after it.
  static absl::Duration TickFor(absl::Duration timeout, absl::Duration longest);

 private:
  void Run();

  const absl::Duration tick_;
  absl::AnyInvocable<bool(absl::Time)> sweep_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool woken_ ABSL_GUARDED_BY(mu_) = true;
  std::thread thread_;
};

}  // namespace attnserve
