#include "server/grpc/attention_service.h"

#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "spdlog/spdlog.h"
#include "server/grpc/convert.h"
#include "server/grpc/status_mapping.h"

namespace attnserve {
namespace {

// Requests kept for reuse, and the most buffer capacity they may hold: enough
// for 256 in-flight decode requests of 64 sequences, while a rare 128 MiB
// prefill's query is freed after use rather than kept.
constexpr size_t kPooledPrefillRequests = 256;
constexpr int64_t kPooledPrefillBytes = int64_t{256} << 20;

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(AttentionCore* core, const TokenAuth* auth,
                                           Metrics* metrics, bool access_log)
    : core_(core),
      auth_(auth),
      metrics_(metrics),
      access_log_(access_log),
      prefill_requests_(kPooledPrefillRequests, kPooledPrefillBytes,
                        [](v1::PrefillRequest* r) { return ResetForReuse(r); }) {}

// One RPC in flight: authenticates, and on Finish records the metrics and
// finishes the reactor. Deletes itself when finished.
class AttentionServiceImpl::Call {
 public:
  Call(AttentionServiceImpl* service, grpc::CallbackServerContext* ctx, const char* method,
       int64_t bytes_in)
      : service_(service),
        ctx_(ctx),
        reactor_(ctx->DefaultReactor()),
        method_(method),
        start_(absl::Now()) {
    service_->metrics_->inflight().Increment();
    service_->metrics_->AddTransferBytes(bytes_in, 0);
    if (service_->draining_) {
      status_ = absl::UnavailableError("server is draining");
      return;
    }
    accepted_ = true;
    ++service_->accepted_inflight_;
    absl::string_view authorization;
    auto it = ctx->client_metadata().find("authorization");
    if (it != ctx->client_metadata().end()) {
      authorization = absl::string_view(it->second.data(), it->second.size());
    }
    auto tenant = service_->auth_->Authenticate(authorization);
    if (tenant.ok()) {
      tenant_ = *std::move(tenant);
    } else {
      status_ = tenant.status();
    }
  }

  // False when authentication (or draining) already failed the call; then
  // Finish has to be called with status().
  bool ok() const { return status_.ok(); }
  const absl::Status& status() const { return status_; }
  const std::string& tenant() const { return tenant_; }
  grpc::ServerUnaryReactor* reactor() const { return reactor_; }

  // Fills the caller, deadline and cancellation probe of a core call struct.
  template <typename CallT>
  void Bind(CallT* c) const {
    c->tenant = tenant_;
    const auto deadline = ctx_->deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      c->deadline = absl::FromChrono(deadline);
    }
    grpc::CallbackServerContext* ctx = ctx_;
    c->is_cancelled = [ctx] { return ctx->IsCancelled(); };
  }

  void Finish(const absl::Status& status, int64_t bytes_out = 0) {
    grpc::Status grpc_status = ToGrpcStatus(status);
    Metrics* metrics = service_->metrics_;
    metrics->ObserveRequest(method_, GrpcCodeName(grpc_status.error_code()),
                            absl::ToDoubleSeconds(absl::Now() - start_));
    if (status.ok()) metrics->AddTransferBytes(0, bytes_out);
    metrics->inflight().Decrement();
    if (accepted_) {
      service_->last_accepted_finish_ns_ = absl::GetCurrentTimeNanos();
      --service_->accepted_inflight_;
    }
    if (service_->access_log_) {
      spdlog::info("access method={} tenant={} code={} seconds={:.6f} bytes_out={}", method_,
                   tenant_.empty() ? "-" : tenant_, GrpcCodeName(grpc_status.error_code()),
                   absl::ToDoubleSeconds(absl::Now() - start_), bytes_out);
    }
    grpc::ServerUnaryReactor* reactor = reactor_;
    delete this;
    reactor->Finish(grpc_status);
  }

 private:
  AttentionServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  grpc::ServerUnaryReactor* const reactor_;
  const char* const method_;
  const absl::Time start_;
  absl::Status status_;
  std::string tenant_;
  bool accepted_ = false;  // arrived before the drain began
};

grpc::ServerUnaryReactor* AttentionServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* ctx, const v1::GetServerInfoRequest*, v1::ServerInfo* response) {
  auto* call = new Call(this, ctx, "GetServerInfo", 0);
  grpc::ServerUnaryReactor* reactor = call->reactor();
  if (!call->ok()) {
    call->Finish(call->status());
    return reactor;
  }
  ServerInfoData info = core_->Info();
  response->set_version(info.version);
  response->set_backend(info.backend);
  response->set_device(info.device);
  response->set_num_layers(info.num_layers);
  response->set_num_pages(info.num_pages);
  response->set_page_size(info.page_size);
  response->set_num_qo_heads(info.num_qo_heads);
  response->set_num_kv_heads(info.num_kv_heads);
  response->set_head_dim(info.head_dim);
  response->set_kv_dtype(static_cast<v1::DType>(info.kv_dtype));
  response->set_free_pages(info.free_pages);
  response->set_max_batch_tokens(info.max_batch_tokens);
  response->set_max_message_bytes(info.max_message_bytes);
  response->set_incarnation(info.incarnation);
  call->Finish(absl::OkStatus());
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::AllocatePages(
    grpc::CallbackServerContext* ctx, const v1::AllocatePagesRequest* request,
    v1::AllocatePagesResponse* response) {
  auto* call = new Call(this, ctx, "AllocatePages", 0);
  grpc::ServerUnaryReactor* reactor = call->reactor();
  if (!call->ok()) {
    call->Finish(call->status());
    return reactor;
  }
  auto pages = core_->AllocatePages(call->tenant(), request->count());
  if (pages.ok()) {
    response->mutable_page_ids()->Assign(pages->begin(), pages->end());
    response->set_incarnation(core_->incarnation());
  }
  call->Finish(pages.status());
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::FreePages(grpc::CallbackServerContext* ctx,
                                                          const v1::FreePagesRequest* request,
                                                          v1::FreePagesResponse*) {
  auto* call = new Call(this, ctx, "FreePages", 0);
  grpc::ServerUnaryReactor* reactor = call->reactor();
  if (!call->ok()) {
    call->Finish(call->status());
    return reactor;
  }
  core_->FreePages(call->tenant(),
                   absl::MakeConstSpan(request->page_ids().data(),
                                       static_cast<size_t>(request->page_ids_size())),
                   [call](absl::Status status) { call->Finish(status); });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::WriteKV(grpc::CallbackServerContext* ctx,
                                                        const v1::WriteKVRequest* request,
                                                        v1::WriteKVResponse*) {
  auto* call = new Call(this, ctx, "WriteKV",
                        static_cast<int64_t>(request->k().data().size() + request->v().data().size()));
  grpc::ServerUnaryReactor* reactor = call->reactor();
  if (!call->ok()) {
    call->Finish(call->status());
    return reactor;
  }
  WriteKvCall c;
  call->Bind(&c);
  ToCall(*request, &c);
  core_->WriteKv(c, [call](absl::Status status) { call->Finish(status); });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ReadKV(grpc::CallbackServerContext* ctx,
                                                       const v1::ReadKVRequest* request,
                                                       v1::ReadKVResponse* response) {
  auto* call = new Call(this, ctx, "ReadKV", 0);
  grpc::ServerUnaryReactor* reactor = call->reactor();
  if (!call->ok()) {
    call->Finish(call->status());
    return reactor;
  }
  ReadKvCall c;
  call->Bind(&c);
  ToCall(*request, response, &c);
  const KvGeometry& g = core_->geometry();
  const auto dtype = static_cast<v1::DType>(ToWire(g.dtype));
  const int64_t n = request->slots_size();
  core_->ReadKv(c, [call, response, dtype, n, g](absl::Status status) {
    if (status.ok()) {
      SetTensorHeader(response->mutable_k(), dtype, {n, g.num_kv_heads, g.head_dim});
      SetTensorHeader(response->mutable_v(), dtype, {n, g.num_kv_heads, g.head_dim});
    }
    call->Finish(status, static_cast<int64_t>(response->k().data().size() +
                                              response->v().data().size()));
  });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::Prefill(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* request_bytes,
                                                        grpc::ByteBuffer* response) {
  auto* call = new Call(this, ctx, "Prefill", 0);
  grpc::ServerUnaryReactor* reactor = call->reactor();
  if (!call->ok()) {
    call->Finish(call->status());
    return reactor;
  }
  // What the request and its output need until the response is encoded.
  struct State {
    RecyclingPool<v1::PrefillRequest>::Ptr request;
    PrefillOutput out;
  };
  auto* state = new State{prefill_requests_.Get(), {}};
  const v1::PrefillRequest& request = *state->request;
  if (!ParseInto(*request_bytes, state->request.get())) {
    delete state;
    call->Finish(absl::InvalidArgumentError(
        "request does not parse as an attnserve.v1.PrefillRequest"));
    return reactor;
  }
  metrics_->AddTransferBytes(static_cast<int64_t>(request.q().data().size() +
                                                  request.append_k().data().size() +
                                                  request.append_v().data().size()),
                             0);
  PrefillCall c;
  call->Bind(&c);
  ToCall(request, &c);
  c.out = &state->out;
  const KvGeometry& g = core_->geometry();
  const auto dtype = static_cast<v1::DType>(ToWire(g.dtype));
  const int64_t total_q = c.q.shape.empty() ? 0 : c.q.shape[0];
  const uint64_t incarnation = core_->incarnation();
  core_->Prefill(c, [call, state, response, dtype, total_q, g, incarnation](absl::Status status) {
    int64_t bytes_out = 0;
    if (status.ok()) {
      bytes_out = state->out.o_bytes + state->out.lse_bytes;
      *response = EncodePrefillResponse(std::move(state->out), dtype, total_q, g.num_qo_heads,
                                        g.head_dim, incarnation);
    }
    delete state;  // the request goes back to the pool; the output lives in the response
    call->Finish(status, bytes_out);
  });
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::MergeStates(
    grpc::CallbackServerContext* ctx, const v1::MergeStatesRequest* request,
    v1::MergeStatesResponse* response) {
  int64_t bytes_in = 0;
  for (const auto& s : request->states()) bytes_in += s.v().data().size() + s.lse().data().size();
  auto* call = new Call(this, ctx, "MergeStates", bytes_in);
  grpc::ServerUnaryReactor* reactor = call->reactor();
  if (!call->ok()) {
    call->Finish(call->status());
    return reactor;
  }
  MergeStatesCall c;
  call->Bind(&c);
  ToCall(*request, response, &c);
  std::vector<int64_t> shape;
  if (!c.v.empty()) shape = c.v[0].shape;  // validated rank 3 when the merge succeeds
  const auto dtype = static_cast<v1::DType>(ToWire(core_->geometry().dtype));
  core_->MergeStates(c, [call, response, dtype, shape](absl::Status status) {
    if (status.ok()) {
      SetTensorHeader(response->mutable_v(), dtype, shape);
      SetTensorHeader(response->mutable_lse(), v1::DTYPE_FP32,
                      absl::MakeConstSpan(shape.data(), 2));
    } else {
      response->Clear();
    }
    call->Finish(status, static_cast<int64_t>(response->v().data().size() +
                                              response->lse().data().size()));
  });
  return reactor;
}

}  // namespace attnserve
