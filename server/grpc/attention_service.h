// The gRPC edge of attnserve.v1.AttentionService (callback API).
//
// Every method is a raw method: the handler gets the request's wire bytes,
// authenticates the caller from the metadata before anything is parsed,
// checks the bytes against the request's wire limits (wire_limits.h) and
// only then parses them, so that no request, with or without a token, costs
// much more memory than its own size. It converts the parsed proto into the
// core's plain structs (views, no tensor copies) and returns the reactor at
// once; the core finishes it, from the scheduler's threads for queued work.
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
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "server/channel/channel_server.h"
#include "server/core/attention_core.h"
#include "server/grpc/auth.h"
#include "server/grpc/message_pool.h"
#include "server/grpc/wire_limits.h"
#include "server/metrics.h"

namespace attnserve {

using RawAttentionService = v1::AttentionService::WithRawCallbackMethod_GrantLease<
    v1::AttentionService::WithRawCallbackMethod_KeepAlive<
    v1::AttentionService::WithRawCallbackMethod_RevokeLease<
    v1::AttentionService::WithRawCallbackMethod_ListHoldings<
    v1::AttentionService::WithRawCallbackMethod_ReleaseHoldings<
    v1::AttentionService::WithRawCallbackMethod_OpenChannel<
    v1::AttentionService::WithRawCallbackMethod_CloseChannel<
    v1::AttentionService::WithRawCallbackMethod_RegisterRegion<
    v1::AttentionService::WithRawCallbackMethod_UnregisterRegion<
    v1::AttentionService::WithRawCallbackMethod_ListRegions<
    v1::AttentionService::WithRawCallbackMethod_CreatePlan<
    v1::AttentionService::WithRawCallbackMethod_ReleasePlan<
    v1::AttentionService::WithRawCallbackMethod_GetServerInfo<
    v1::AttentionService::WithRawCallbackMethod_AllocatePages<
        v1::AttentionService::WithRawCallbackMethod_FreePages<
            v1::AttentionService::WithRawCallbackMethod_WriteKV<
                v1::AttentionService::WithRawCallbackMethod_ReadKV<
                    v1::AttentionService::WithRawCallbackMethod_Prefill<
                        v1::AttentionService::WithRawCallbackMethod_MergeStates<
                            v1::AttentionService::Service>>>>>>>>>>>>>>>>>>>;

class AttentionServiceImpl final : public RawAttentionService {
 public:
  // access_log: one log line per finished RPC (method, tenant, peer, request
  // id, code, seconds, bytes, error text), and per channel request.
  // channels: how the pollers of request channels (OpenChannel) poll.
  AttentionServiceImpl(AttentionCore* core, const TokenAuth* auth, Metrics* metrics,
                       bool access_log, ChannelServerOptions channels = {});
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

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* AllocatePages(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* FreePages(grpc::CallbackServerContext* ctx,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* WriteKV(grpc::CallbackServerContext* ctx,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ReadKV(grpc::CallbackServerContext* ctx,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* MergeStates(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CreatePlan(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ReleasePlan(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RegisterRegion(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* ctx,
                                             const grpc::ByteBuffer* request,
                                             grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* OpenChannel(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CloseChannel(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GrantLease(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* ctx,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RevokeLease(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListHoldings(grpc::CallbackServerContext* ctx,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ReleaseHoldings(grpc::CallbackServerContext* ctx,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;

 private:
  class Call;

  // A new call, admitted (not draining, authenticated) or already finished
  // with the reason it was not; call->finished() tells which.
  Call* Start(grpc::CallbackServerContext* ctx, Metrics::Rpc rpc,
              const grpc::ByteBuffer* request, grpc::ByteBuffer* response);

  AttentionCore* const core_;
  const TokenAuth* const auth_;
  Metrics* const metrics_;
  const bool access_log_;
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
};

}  // namespace attnserve
