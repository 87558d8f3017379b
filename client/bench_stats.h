// What the command-line load generators (client/attnbench.cc,
// bench/cluster_decode_bench.cc) share: the latency and error tally of a run,
// with nearest-rank percentiles, and a server's Prometheus /metrics read over
// plain HTTP. Not part of the installed client library.
//
//   LatencyStats stats;                        // shared by every client thread
//   stats.Record(seconds, status, /*wrong=*/false, /*rows=*/64, /*flops=*/0);
//   const LatencyStats::Snapshot s = stats.Take(/*with_samples=*/false);
//   double p99_s = s.Percentile(99);
//
//   auto text = FetchMetrics("127.0.0.1:9464");
//   auto batches = SumMetric(*text, "attnserve_batch_requests_count");
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

// Every request of a run: its latency when it succeeded, its error code when
// it did not, and whether a verified result was wrong. Thread-safe.
class LatencyStats {
 public:
  // Latency samples a Snapshot keeps at most (evenly strided).
  static constexpr size_t kMaxSamples = 100000;

  // One finished request: latency in seconds, `rows` query rows and `flops`
  // of attention it asked for (counted only when status is OK).
  void Record(double latency_s, const absl::Status& status, bool wrong, int64_t rows,
              double flops);
  // An open-loop arrival that found every client busy.
  void Dropped();
  int64_t done() const;

  struct Snapshot {
    int64_t done = 0, ok = 0, wrong = 0, dropped = 0, rows = 0;
    double flops = 0;
    std::map<std::string, int64_t> errors;  // by status code name
    std::vector<double> sorted;   // OK latencies, seconds, ascending
    std::vector<double> samples;  // at most kMaxSamples, in arrival order
    // Failed requests plus wrong results.
    int64_t Errors() const;
    // Nearest rank, in seconds; 0 when nothing was measured.
    double Percentile(double p) const;
  };
  Snapshot Take(bool with_samples) const;

 private:
  mutable absl::Mutex mu_;
  int64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t ok_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t wrong_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t rows_ ABSL_GUARDED_BY(mu_) = 0;
  double flops_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int64_t> errors_ ABSL_GUARDED_BY(mu_);
  std::vector<double> latencies_ ABSL_GUARDED_BY(mu_);
};

// "12.345": seconds as milliseconds with three decimals.
std::string FormatMs(double seconds);

// GET http://ADDRESS/metrics (HTTP/1.0; ADDRESS is HOST:PORT): the exposition
// text. UNAVAILABLE when the server cannot be reached, INTERNAL for a status
// other than 200.
absl::StatusOr<std::string> FetchMetrics(const std::string& address);

// Sum of every sample named exactly `name` (e.g.
// "attnserve_batch_requests_sum") whose label set contains `label` (e.g.
// `method="Prefill"`; "" matches any) and not `exclude` ("" excludes none).
// NOT_FOUND when no sample matches.
absl::StatusOr<double> SumMetric(absl::string_view text, absl::string_view name,
                                 absl::string_view label = "", absl::string_view exclude = "");

}  // namespace attnserve
