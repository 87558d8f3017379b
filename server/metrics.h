// Metrics: the Prometheus families of docs/design.md section 7, built once on one
// registry. Components keep a pointer to Metrics and update it; the exposer
// (server/grpc/server.cc) serves the registry on --metrics_listen.
#pragma once

#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace attnserve {

class Metrics {
 public:
  Metrics();

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // One finished RPC: method is the RPC name, code the gRPC code name
  // ("OK", "INVALID_ARGUMENT", ...), seconds the handler's wall time.
  void ObserveRequest(absl::string_view method, absl::string_view code, double seconds);
  void ObserveQueueWait(double seconds) { queue_wait_->Observe(seconds); }
  void ObserveBatch(int requests, int64_t tokens);
  enum class Kernel { kAttention, kMerge, kAppend };
  // Launches of one kernel in a batch and their device (or CPU) seconds.
  void ObserveKernel(Kernel kernel, int launches, double seconds);
  // Host time of one batch stage: submit (plan, pack, queue), wait (for the
  // device), unpack (outputs to the responses), finish (pages unpinned,
  // responses handed to gRPC).
  enum class Stage { kSubmit, kWait, kUnpack, kFinish };
  void ObserveStage(Stage stage, double seconds);
  void SetKvPages(int64_t free_pages, int64_t used_pages);
  void AddTransferBytes(int64_t in_bytes, int64_t out_bytes);
  prometheus::Gauge& inflight() { return *inflight_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* requests_total_;
  prometheus::Family<prometheus::Histogram>* request_duration_;
  prometheus::Histogram* queue_wait_;
  prometheus::Histogram* batch_requests_;
  prometheus::Histogram* batch_tokens_;
  // Series of the fixed label values, indexed by Kernel and Stage: created
  // once, so a batch's observations look nothing up.
  prometheus::Counter* kernel_launches_[3];
  prometheus::Histogram* kernel_duration_[3];
  prometheus::Histogram* batch_stage_[4];
  prometheus::Gauge* kv_free_;
  prometheus::Gauge* kv_used_;
  prometheus::Counter* bytes_in_;
  prometheus::Counter* bytes_out_;
  prometheus::Gauge* inflight_;
};

}  // namespace attnserve
