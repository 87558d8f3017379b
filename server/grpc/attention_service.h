// The gRPC edge of attnserve.v1.AttentionService (callback API).
//
// Each handler authenticates the caller, converts the request proto into the
// core's plain structs (views, no tensor copies), and returns the reactor at
// once; the core finishes it, from the scheduler thread for queued work.
// Status conversion happens in exactly one place (status_mapping.h).
//
// Prefill, the hot path, is a raw method: its request is parsed into a
// recycled message (the query lands in a buffer that is already mapped), and
// its response is sent straight from the output buffer the backend filled
// (pinned memory the device copied into, on CUDA): no zero-fill, no copy into
// the response message, no serialization copy.
#pragma once

#include <atomic>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/core/attention_core.h"
#include "server/grpc/auth.h"
#include "server/grpc/message_pool.h"
#include "server/metrics.h"

namespace attnserve {

class AttentionServiceImpl final
    : public v1::AttentionService::WithRawCallbackMethod_Prefill<
          v1::AttentionService::CallbackService> {
 public:
  // access_log: one log line per finished RPC (method, tenant, code, time).
  AttentionServiceImpl(AttentionCore* core, const TokenAuth* auth, Metrics* metrics,
                       bool access_log);

  // New requests get UNAVAILABLE from now on (graceful drain).
  void StartDraining() { draining_ = true; }
  // RPCs accepted before the drain began and still being handled.
  int64_t accepted_inflight() const { return accepted_inflight_; }
  // When the last accepted RPC finished (absl::GetCurrentTimeNanos()).
  int64_t last_accepted_finish_ns() const { return last_accepted_finish_ns_; }

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* AllocatePages(grpc::CallbackServerContext* ctx,
                                          const v1::AllocatePagesRequest* request,
                                          v1::AllocatePagesResponse* response) override;
  grpc::ServerUnaryReactor* FreePages(grpc::CallbackServerContext* ctx,
                                      const v1::FreePagesRequest* request,
                                      v1::FreePagesResponse* response) override;
  grpc::ServerUnaryReactor* WriteKV(grpc::CallbackServerContext* ctx,
                                    const v1::WriteKVRequest* request,
                                    v1::WriteKVResponse* response) override;
  grpc::ServerUnaryReactor* ReadKV(grpc::CallbackServerContext* ctx,
                                   const v1::ReadKVRequest* request,
                                   v1::ReadKVResponse* response) override;
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* MergeStates(grpc::CallbackServerContext* ctx,
                                        const v1::MergeStatesRequest* request,
                                        v1::MergeStatesResponse* response) override;

 private:
  class Call;

  AttentionCore* const core_;
  const TokenAuth* const auth_;
  Metrics* const metrics_;
  const bool access_log_;
  std::atomic<bool> draining_{false};
  std::atomic<int64_t> accepted_inflight_{0};
  std::atomic<int64_t> last_accepted_finish_ns_{0};
  // Prefill requests are recycled with their tensor buffers (message_pool.h).
  RecyclingPool<v1::PrefillRequest> prefill_requests_;
};

}  // namespace attnserve
