// ChannelServer: the edge of request channels (docs/transport.md, "Request
// channels"). For each channel the core admits (AttentionCore::OpenChannel),
// one poller thread watches the ring's slots (common/channel_layout.h) in
// the client's system region and runs each request it finds through the
// same steps as the gRPC Prefill handler: the bytes copied out of the slot
// once, checked against the same wire limits, parsed in place into a pooled
// request (convert.h), handed to the core, and the response encoded by
// EncodePrefillResponse and copied into the slot.
//
// The poller spins on the slots' request_seq words for spin_us after the
// last request (one busy core), then sleeps on the header's server_wake
// futex, which the client wakes when it posts a request while
// server_sleeping is set; the wait is timed (sleep_timeout) so that a close
// is noticed even with no client left. Requests of several slots run
// concurrently and batch in the scheduler like concurrent RPCs.
//
//   ChannelServer channels(core, metrics, &limits, &pool, ChannelServerOptions{});
//   auto opened = channels.Open(ctx, ring);  // ctx: tenant, expected incarnation
//   ...
//   channels.Close(ctx, opened->id);
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/core/attention_core.h"
#include "server/grpc/message_pool.h"
#include "server/grpc/wire_limits.h"
#include "server/metrics.h"

namespace attnserve {

struct ChannelServerOptions {
  int64_t spin_us = 200;  // --channel_spin_us: polling after the last request, then sleep
  absl::Duration sleep_timeout = absl::Milliseconds(50);  // longest futex sleep
  bool access_log = false;  // one log line per request, as --access_log does for RPCs
};

class ChannelServer {
 public:
  // `limits` and `requests` (the gRPC edge's) must outlive this.
  ChannelServer(AttentionCore* core, Metrics* metrics, const RequestWireLimits* limits,
                RecyclingPool<v1::PrefillRequest>* requests, ChannelServerOptions options);
  // Closes every channel and waits for their pollers (which wait for the
  // requests they took).
  ~ChannelServer();
  ChannelServer(const ChannelServer&) = delete;
  ChannelServer& operator=(const ChannelServer&) = delete;

  struct Opened {
    uint64_t id = 0;
    int32_t slot_count = 0;
    int32_t slot_bytes = 0;
  };
  // OpenChannel for ctx's tenant (AttentionCore::OpenChannel's errors).
  absl::StatusOr<Opened> Open(const CallContext& ctx, const RegionRefView& ring);
  absl::Status Close(const CallContext& ctx, uint64_t channel_id);

  // New requests in any ring are answered UNAVAILABLE from now on.
  void StartDraining() { draining_ = true; }
  // Requests taken from rings and not yet answered.
  int64_t inflight() const { return inflight_.load(); }
  // Answers every request still in flight with `status` (written into its
  // slot) and returns how many there were; their work is never answered.
  int AbandonInflight(const absl::Status& status);

 private:
  class Poller;
  struct Request;

  // Answers a request once (the first of its done callback and
  // AbandonInflight); false when it was answered already.
  bool Finish(Request* request, const absl::Status& status, grpc::ByteBuffer* response);
  void ThreadDone();
  // A Prefill request stage (Metrics::RequestStage): the time since the
  // request's previous mark.
  void ObserveStage(Request* request, Metrics::RequestStage stage);

  AttentionCore* const core_;
  Metrics* const metrics_;
  const RequestWireLimits* const limits_;
  RecyclingPool<v1::PrefillRequest>* const requests_;
  const ChannelServerOptions options_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> inflight_{0};
  std::atomic<uint64_t> next_request_id_{1};
  absl::Mutex mu_;
  absl::flat_hash_set<Request*> taken_ ABSL_GUARDED_BY(mu_);  // for AbandonInflight
  int live_threads_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace attnserve
