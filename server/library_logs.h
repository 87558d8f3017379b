// The log lines of the libraries the server links (protobuf, gRPC), routed
// through the server's own log (spdlog) and limited per cause: a client
// that sends a malformed request thousands of times a second must not write
// thousands of lines (docs/operations.md, "Logs").
//
//   RouteLibraryLogs();   // once, at start, before the gRPC server exists
//
// A cause is where the line comes from (the library's file and line): at
// most one line per cause is written each second, and the next one written
// says how many were dropped since ("[12 more like this in 1.0 s]").
#pragma once

#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

// Decides which lines of a cause are written: at most one per `period`.
// Thread-safe.
class LogLimiter {
 public:
  explicit LogLimiter(absl::Duration period = absl::Seconds(1)) : period_(period) {}

  // True when a line of `cause` may be written at `now`; *dropped then gets
  // how many lines of that cause were dropped since the last one written.
  bool Allow(absl::string_view cause, absl::Time now, int64_t* dropped);

 private:
  struct Cause {
    absl::Time last_written = absl::InfinitePast();
    int64_t dropped = 0;
  };
  const absl::Duration period_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Cause> causes_ ABSL_GUARDED_BY(mu_);
};

// Sends protobuf's and gRPC's log lines to spdlog through one LogLimiter.
void RouteLibraryLogs();

}  // namespace attnserve
