// The gRPC edge of attnserve.v1.AttentionService (callback API).
//
// Every method is served as a streaming raw callback method, so that a call
// is admitted before a byte of its request is read: a call during a drain gets
// UNAVAILABLE, an unknown method UNIMPLEMENTED and a caller without a valid
// token UNAUTHENTICATED straight from its metadata, and their bodies are
// never accepted (gRPC buffers at most the stream's flow-control window of
// them, and frees it when the call ends). Only an admitted call reads its
// request, which must arrive within ServiceOptions::read_timeout. The
// handler then checks the request's wire bytes against its wire limits
// (wire_limits.h) and only then parses them, so that no request costs much
// more memory than its own size. It converts the parsed proto into the
// core's plain structs (views, no tensor copies) and returns at once; the
// core finishes the call, from the scheduler's threads for queued work.
// Status conversion happens in exactly one place (status_mapping.h).
//
// Prefill, the hot path, parses its small fields into a recycled message
// and leaves its tensors' data in the slices gRPC received (InPlaceTensors,
// convert.h), from which the backend copies it where it goes (on CUDA, into
// its pinned staging): no copy on the edge; WriteKV's k and v likewise. Its
// response is sent straight from the output buffer the backend filled
// (pinned memory the device copied into, on CUDA): no zero-fill, no copy
// into a response message, no serialization copy. ReadKV and MergeStates
// responses are likewise sent from the strings the backend wrote
// (common/tensor_wire.h), not serialized into a copy.
//
// A call whose client cancels leaves the scheduler's queue at once
// (AttentionCore::Cancel). At the end of a drain, AbandonInflight answers
// every call still running with UNAVAILABLE, so that shutdown never waits
// on a batch.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/support/server_callback.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "server/channel/channel_server.h"
#include "server/core/attention_core.h"
#include "server/grpc/auth.h"
#include "server/grpc/message_pool.h"
#include "server/grpc/read_sweeper.h"
#include "server/grpc/wire_limits.h"
#include "server/metrics.h"

namespace attnserve {

inline constexpr char kServiceName[] = "attnserve.v1.AttentionService";

struct ServiceOptions {
  // One log line per finished RPC (method, tenant, peer, request id, code,
  // seconds, bytes, error text), and per channel request.
  bool access_log = false;
  // An admitted call's request must have arrived this long after the call
  // began, or the call is cut off (DEADLINE_EXCEEDED naming the flag): a
  // stalled sender holds nothing for longer (--request_read_timeout_s).
  absl::Duration read_timeout = absl::Seconds(60);
  // How the pollers of request channels (OpenChannel) poll.
  ChannelServerOptions channels;
};

// The service's methods are registered as raw callback methods of the
// streaming kind, although clients call them as unary ones (the wire is the
// same): gRPC then hands each call over when its metadata arrives, where a
// unary method's call would come only with its whole request.
class AttentionServiceImpl final : public grpc::Service {
 public:
  AttentionServiceImpl(AttentionCore* core, const TokenAuth* auth, Metrics* metrics,
                       ServiceOptions options);
  ~AttentionServiceImpl() override;

  // New requests get UNAVAILABLE from now on (graceful drain), over gRPC and
  // through channels.
  void StartDraining() {
    draining_ = true;
    channels_->StartDraining();
  }
  // RPCs accepted before the drain began and still being handled, and
  // channel requests being handled.
  int64_t accepted_inflight() const { return accepted_inflight_ + channels_->inflight(); }
  // When the last accepted RPC finished (absl::GetCurrentTimeNanos()).
  int64_t last_accepted_finish_ns() const { return last_accepted_finish_ns_; }
  // Finishes every RPC and channel request still in flight with `status`
  // and returns how many there were. Work they queued or started is never
  // answered: the process is about to exit.
  int AbandonInflight(const absl::Status& status);
  // The region socket's name, which GetServerInfo reports (set once, right
  // after the server binds its port).
  void SetRegionSocket(std::string name) {
    absl::MutexLock lock(&region_socket_mu_);
    region_socket_ = std::move(name);
  }

 private:
  class Call;
  // A method's handler runs once its call is admitted and its request has
  // arrived; it finishes the call, at once or from the core's callback.
  using Handler = void (AttentionServiceImpl::*)(Call*);
  // Adds every method of the service, each with its handler.
  void RegisterMethods();

  void GetServerInfo(Call* call);
  void AllocatePages(Call* call);
  void FreePages(Call* call);
  void WriteKV(Call* call);
  void ReadKV(Call* call);
  void Prefill(Call* call);
  void MergeStates(Call* call);
  void CreatePlan(Call* call);
  void ReleasePlan(Call* call);
  void RegisterRegion(Call* call);
  void UnregisterRegion(Call* call);
  void ListRegions(Call* call);
  void OpenChannel(Call* call);
  void CloseChannel(Call* call);
  void GrantLease(Call* call);
  void KeepAlive(Call* call);
  void RevokeLease(Call* call);
  void ListHoldings(Call* call);
  void ReleaseHoldings(Call* call);
  void SetKvScales(Call* call);
  void GetKvScales(Call* call);

  AttentionCore* const core_;
  const TokenAuth* const auth_;
  Metrics* const metrics_;
  const bool access_log_;
  const absl::Duration read_timeout_;
  // By full method name ("/attnserve.v1.AttentionService/Prefill").
  // The full method names ("/attnserve.v1.AttentionService/Prefill"), which
  // gRPC's method table points into.
  std::vector<std::string> method_names_;
  const RequestWireLimits limits_;
  std::atomic<bool> draining_{false};
  absl::Mutex region_socket_mu_;
  std::string region_socket_ ABSL_GUARDED_BY(region_socket_mu_);
  std::atomic<int64_t> accepted_inflight_{0};
  std::atomic<int64_t> last_accepted_finish_ns_{0};
  std::atomic<uint64_t> next_request_id_{1};
  // Calls not yet done, for AbandonInflight.
  absl::Mutex calls_mu_;
  absl::flat_hash_set<Call*> calls_ ABSL_GUARDED_BY(calls_mu_);
  // Prefill requests are recycled with their tensor buffers (message_pool.h).
  RecyclingPool<v1::PrefillRequest> prefill_requests_;
  // Request channels' pollers; they share limits_ and prefill_requests_
  // (destroyed first: it waits for its pollers).
  std::unique_ptr<ChannelServer> channels_;
  // The read timeout of every call (read_sweeper.h): finishes the calls
  // whose request is overdue.
  bool SweepReads(absl::Time now);
  std::unique_ptr<ReadSweeper> sweeper_;  // stopped first (the destructor)
};

}  // namespace attnserve
