#include "client/client.h"
#include "client/connect_checks.h"
#include "client/raw_methods.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/shared_memory.h"
#include "common/flag_file.h"
#include "common/region_socket.h"
#include "common/tensor_wire.h"
#include "common/transport.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/client_unary_call.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attnserve {
namespace {

// "A vs. B" in gRPC's "Sent message larger than max (A vs. B)": the
// message's bytes and the limit.
bool SizesOf(absl::string_view message, int64_t* bytes, int64_t* limit) {
  const size_t open = message.find('(');
  const size_t vs = message.find(" vs. ");
  const size_t close = message.find(')', vs == absl::string_view::npos ? 0 : vs);
  return open != absl::string_view::npos && vs != absl::string_view::npos &&
         close != absl::string_view::npos && open < vs &&
         absl::SimpleAtoi(message.substr(open + 1, vs - open - 1), bytes) &&
         absl::SimpleAtoi(message.substr(vs + 5, close - vs - 5), limit);
}

// now + `seconds` as a deadline: a non-finite or huge value is capped (at
// about three years), so that no conversion overflows.
std::chrono::system_clock::time_point DeadlineIn(double seconds) {
  constexpr double kMaxSeconds = 1e8;
  const double s = std::isfinite(seconds) ? std::min(std::max(seconds, 0.0), kMaxSeconds) : kMaxSeconds;
  return std::chrono::system_clock::now() + std::chrono::microseconds(static_cast<int64_t>(s * 1e6));
}

}  // namespace

Client::Client() = default;
Client::~Client() = default;

grpc::Status Client::CallRaw(const grpc::internal::RpcMethod& method, grpc::ByteBuffer request,
                             grpc::ByteBuffer* response) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  if (!options_.busy_poll) {
    return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
        channel_.get(), method, &ctx, request, response);
  }
  // The same call, its completion polled with a zero timeout until it comes
  // (each poll also reads the socket). The call's deadline still ends it.
  grpc::CompletionQueue cq;
  grpc::Status status;
  {
    grpc::GenericStub stub(channel_);
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub.PrepareUnaryCall(&ctx, method.name(), request, &cq);
    call->StartCall();
    int done_tag = 0;
    call->Finish(response, &status, &done_tag);
    void* tag = nullptr;
    bool ok = false;
    for (;;) {
      const grpc::CompletionQueue::NextStatus next =
          cq.AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
      if (next == grpc::CompletionQueue::GOT_EVENT && tag == &done_tag) break;
      if (next == grpc::CompletionQueue::SHUTDOWN) {
        return grpc::Status(grpc::StatusCode::INTERNAL, "completion queue shut down during a call");
      }
    }
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

absl::Status Client::FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const std::string& m = status.error_message();
  int64_t bytes = 0, limit = 0;
  if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
      (absl::StartsWith(m, "Sent message larger than max") ||
       absl::StartsWith(m, "Received message larger than max")) &&
      SizesOf(m, &bytes, &limit)) {
    // gRPC's own check of this client's limit (the server's says the same
    // in its own words).
    const bool sent = absl::StartsWith(m, "Sent");
    return absl::ResourceExhaustedError(absl::StrCat(
        sent ? "the request" : "the response", " is ", bytes,
        " bytes, more than this client's max_message_bytes allows (", limit,
        " bytes with 1 MiB for framing): send tensors this large through a shared-memory region "
        "(docs/transport.md; the server needs --allow_shared_memory), or split the request, or "
        "raise max_message_bytes here and --max_message_bytes on the server"));
  }
  // This client never cancels a call itself (its deadlines end calls with
  // DEADLINE_EXCEEDED): a CANCELLED call was cancelled by the server's gRPC,
  // which does that to a call that reaches it in the last moments of a
  // shutdown. For the caller that is "go elsewhere", as for the calls the
  // draining server answered itself.
  if (status.error_code() == grpc::StatusCode::CANCELLED) {
    return absl::UnavailableError(
        absl::StrCat("the server cancelled the call (it was shutting down): ", m));
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), m);
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& given) {
  if (absl::Status bad = CheckClientOptions(given); !bad.ok()) return bad;
  ClientOptions options = given;
  options.tls = UsesTls(given);
  std::unique_ptr<Client> c(new Client());
  c->options_ = options;
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options.tls) {
    grpc::SslCredentialsOptions ssl;
    if (!options.tls_ca.empty()) {
      auto ca = ReadFlagFile("tls_ca", options.tls_ca);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    if (!options.tls_cert.empty()) {
      auto cert = ReadFlagFile("tls_cert", options.tls_cert);
      if (!cert.ok()) return cert.status();
      auto key = ReadFlagFile("tls_key", options.tls_key);
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  const int max_bytes =
      static_cast<int>(std::min<int64_t>(options.max_message_bytes + (1 << 20), INT32_MAX));
  args.SetMaxReceiveMessageSize(max_bytes);
  args.SetMaxSendMessageSize(max_bytes);
  // Each Client gets its own connection (gRPC would otherwise share one TCP
  // connection among channels of the same target), so that N clients in
  // attnbench or the tests really are N concurrent connections.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // Backoff with jitter on UNAVAILABLE, for the idempotent methods only, and
  // requests of any size (gRPC retries none larger than its per-call retry
  // buffer, 256 KiB unless raised).
  args.SetServiceConfigJSON(kClientServiceConfig);
  args.SetInt(GRPC_ARG_PER_RPC_RETRY_BUFFER_SIZE, max_bytes);
  for (const TransportArg& arg : TransportArgs(options.transport_tuning)) {
    args.SetInt(arg.name, arg.value);
  }
  std::vector<std::string> arg_names;
  std::string arg_error;
  for (const TransportArg& arg : ParseTransportArgs(options.grpc_args, &arg_names, &arg_error)) {
    args.SetInt(arg.name, arg.value);  // (a malformed entry: refused by CheckClientOptions above)
  }
  if (options.interceptors) {
    c->channel_ = grpc::experimental::CreateCustomChannelWithInterceptors(
        options.target, creds, args, options.interceptors(options.target));
  } else {
    c->channel_ = grpc::CreateCustomChannel(options.target, creds, args);
  }
  c->stub_ = v1::AttentionService::NewStub(c->channel_);
  c->raw_ = std::make_unique<RawMethods>(c->channel_);
  if (!options.fetch_info) return c;
  // The first call, fail-fast: a cause gRPC names (refused, unresolvable,
  // TLS, an HTTP/1 port) ends it at once; while the connection is in
  // progress, or failed for a reason not named, it is tried again until
  // connect_timeout_s.
  const double wait_s = options.timeout_s > 0 ? std::min(options.timeout_s, options.connect_timeout_s)
                                              : options.connect_timeout_s;
  const auto deadline = DeadlineIn(wait_s);
  v1::ServerInfo info;
  for (;;) {
    grpc::ClientContext ctx;
    c->PrepareContext(&ctx);
    ctx.set_deadline(deadline);
    const grpc::Status s = c->stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info);
    if (s.ok()) break;
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::UnavailableError(absl::StrCat(
          "cannot reach ", options.target, " within ", wait_s, " s (connect_timeout_s): ",
          c->channel_->GetState(false) == GRPC_CHANNEL_READY
              ? "connected, but GetServerInfo got no answer"
              : "no connection completed (a host that is down, or packets dropped on the way)"));
    }
    const std::string cause = ConnectCause(s, options);
    if (!cause.empty()) return absl::UnavailableError(cause);
    // Another transport failure: wait for the next connection attempt.
    // UNAVAILABLE from the server itself (it is draining) is its answer.
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE ||
        !absl::StrContains(s.error_message(), "failed to connect")) {
      return FromGrpc(s);
    }
    const grpc_connectivity_state state = c->channel_->GetState(true);
    if (state != GRPC_CHANNEL_READY) c->channel_->WaitForStateChange(state, deadline);
  }
  // What the client computes from (page counts, divisions by page_size and
  // the head counts) must be a geometry attnserve serves: another server
  // on the port, or a broken one, is refused here, not met later as a
  // division by zero or a wrong result.
  std::string bad = GeometryShapeError(GeometryOf(info), "ServerInfo.");
  if (bad.empty() && info.num_pages() < 1) bad = absl::StrCat("ServerInfo.num_pages=", info.num_pages(), " < 1");
  if (!bad.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        options.target, " answered GetServerInfo with a geometry no attnserve server has (", bad,
        "): is it an attnserve server?"));
  }
  c->Learn(info.incarnation());
  c->info_ = std::move(info);
  return c;
}

void Client::Learn(uint64_t seen) {
  uint64_t expected = 0;
  incarnation_.compare_exchange_strong(expected, seen, std::memory_order_relaxed);
}

void Client::PrepareContext(grpc::ClientContext* ctx) const {
  if (!options_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + options_.token);
  if (options_.timeout_s > 0) ctx->set_deadline(DeadlineIn(options_.timeout_s));
}

absl::StatusOr<v1::ServerInfo> Client::GetServerInfo() {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ServerInfo info;
  grpc::Status s = stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info);
  if (!s.ok()) return FromGrpc(s);
  // A server restarted with another geometry: what this client lays out
  // (slots, page counts, shapes) follows info(), read at Connect.
  // (A client connected without fetch_info has no geometry to keep.)
  if (std::string diff = info_.num_layers() > 0 ? GeometryDifference(GeometryOf(info_), GeometryOf(info), "it had")
                                                : std::string();
      !diff.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        options_.target, " ", kAnotherGeometry, ": ", diff,
        "; this client lays out requests for the geometry it connected to: Connect a new Client"));
  }
  Learn(info.incarnation());
  recheck_geometry_.store(false, std::memory_order_relaxed);
  return info;
}

absl::Status Client::CheckGeometryAfterForget() {
  if (!recheck_geometry_.load(std::memory_order_relaxed)) return absl::OkStatus();
  return GetServerInfo().status();
}

absl::StatusOr<std::vector<int32_t>> Client::AllocatePages(int32_t count) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::AllocatePagesRequest req;
  req.set_count(count);
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  req.set_lease_id(lease_id());
  v1::AllocatePagesResponse resp;
  grpc::Status s = stub_->AllocatePages(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  Learn(resp.incarnation());
  return std::vector<int32_t>(resp.page_ids().begin(), resp.page_ids().end());
}

absl::Status Client::FreePages(absl::Span<const int32_t> page_ids) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::FreePagesRequest req;
  req.mutable_page_ids()->Assign(page_ids.begin(), page_ids.end());
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  req.set_lease_id(lease_id());
  v1::FreePagesResponse resp;
  grpc::Status s = stub_->FreePages(&ctx, req, &resp);
  if (s.ok()) Learn(resp.incarnation());
  return FromGrpc(s);
}

absl::Status Client::SetKvScales(absl::Span<const LayerKvScales> layers) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::SetKvScalesRequest req;
  for (const LayerKvScales& l : layers) {
    v1::LayerKvScales* m = req.add_layers();
    m->set_layer(l.layer);
    m->mutable_k_scale()->Assign(l.k_scale.begin(), l.k_scale.end());
    m->mutable_v_scale()->Assign(l.v_scale.begin(), l.v_scale.end());
  }
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  v1::SetKvScalesResponse resp;
  grpc::Status s = stub_->SetKvScales(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  Learn(resp.incarnation());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<LayerKvScales>> Client::GetKvScales() {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::GetKvScalesResponse resp;
  grpc::Status s = stub_->GetKvScales(&ctx, v1::GetKvScalesRequest(), &resp);
  if (!s.ok()) return FromGrpc(s);
  Learn(resp.incarnation());
  std::vector<LayerKvScales> out;
  for (const v1::LayerKvScales& m : resp.layers()) {
    out.push_back({m.layer(), std::vector<float>(m.k_scale().begin(), m.k_scale().end()),
                   std::vector<float>(m.v_scale().begin(), m.v_scale().end())});
  }
  return out;
}

absl::Status Client::RegisterSystemRegion(const std::string& name, const SharedMemory& memory,
                                          int64_t offset, int64_t byte_size) {
  return RegisterSystemRegionFd(name, memory.fd(), offset, byte_size);
}

absl::Status Client::RegisterSystemRegionFd(const std::string& name, int memfd, int64_t offset,
                                            int64_t byte_size) {
  std::string socket = info_.region_socket();
  uint64_t expected = incarnation();
  if (socket.empty() || expected == 0) {
    // Not read at connect (fetch_info), the server has regions off, or the
    // incarnation was forgotten (a restarted server, whose socket and
    // incarnation are not those read at connect): as the server says now.
    auto fresh = GetServerInfo();
    if (IsAnotherGeometry(fresh.status())) return fresh.status();
    if (fresh.ok()) {
      socket = fresh->region_socket();
      expected = fresh->incarnation();
    }
  }
  if (expected == 0) expected = info_.incarnation();
  RegionClaim claim;
  if (!socket.empty()) {
    auto deposited = DepositRegionFd(socket, memfd, expected,
                                     options_.timeout_s > 0 ? options_.timeout_s : 10);
    if (!deposited.ok()) return deposited.status();
    claim = *std::move(deposited);
  } else {
    // No region socket: the server has regions off, and RegisterRegion says so.
    claim.claim_token.assign(kClaimTokenBytes, '\0');
  }
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::RegisterRegionRequest req;
  req.set_name(name);
  req.set_lease_id(lease_id());
  req.mutable_system()->set_claim_token(claim.claim_token);
  req.mutable_system()->set_offset(offset);
  req.mutable_system()->set_byte_size(byte_size);
  v1::RegisterRegionResponse resp;
  grpc::Status s = stub_->RegisterRegion(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);  // the holder closes: the server drops the deposit
  Learn(resp.incarnation());
  absl::MutexLock lock(&holders_mu_);
  region_holders_[name] = std::move(claim.holder);
  return absl::OkStatus();
}

absl::Status Client::RegisterCudaRegion(const std::string& name, const std::string& ipc_handle,
                                        int32_t device_id, int64_t byte_size) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::RegisterRegionRequest req;
  req.set_name(name);
  req.set_lease_id(lease_id());
  req.mutable_cuda()->set_ipc_handle(ipc_handle);
  req.mutable_cuda()->set_device_id(device_id);
  req.mutable_cuda()->set_byte_size(byte_size);
  v1::RegisterRegionResponse resp;
  grpc::Status s = stub_->RegisterRegion(&ctx, req, &resp);
  if (s.ok()) Learn(resp.incarnation());
  return FromGrpc(s);
}

absl::Status Client::UnregisterRegion(const std::string& name) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::UnregisterRegionRequest req;
  req.set_name(name);
  v1::UnregisterRegionResponse resp;
  const absl::Status status = FromGrpc(stub_->UnregisterRegion(&ctx, req, &resp));
  if (status.ok() || status.code() == absl::StatusCode::kNotFound) {
    absl::MutexLock lock(&holders_mu_);
    region_holders_.erase(name);
  }
  return status;
}

absl::StatusOr<std::vector<v1::RegionInfo>> Client::ListRegions() {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ListRegionsResponse resp;
  grpc::Status s = stub_->ListRegions(&ctx, v1::ListRegionsRequest(), &resp);
  if (!s.ok()) return FromGrpc(s);
  return std::vector<v1::RegionInfo>(resp.regions().begin(), resp.regions().end());
}

std::unique_ptr<Client> Client::Fork() const {
  std::unique_ptr<Client> c(new Client());
  c->options_ = options_;
  c->incarnation_.store(incarnation(), std::memory_order_relaxed);
  c->recheck_geometry_.store(recheck_geometry_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  c->channel_ = channel_;
  c->stub_ = v1::AttentionService::NewStub(channel_);
  c->raw_ = std::make_unique<RawMethods>(channel_);
  c->info_ = info_;
  return c;
}

bool IsLeaseExpired(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         absl::StartsWith(status.message(), "lease ");
}

bool IsStaleIncarnation(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition && !IsLeaseExpired(status) &&
         absl::StrContains(status.message(), "incarnation");
}

bool OutcomeUnknown(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kDataLoss:
      return true;
    default:
      return false;
  }
}

absl::StatusOr<LeaseGrant> Client::GrantLease(int64_t ttl_ms) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::GrantLeaseRequest req;
  req.set_ttl_ms(ttl_ms);
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  v1::GrantLeaseResponse resp;
  grpc::Status s = stub_->GrantLease(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  Learn(resp.incarnation());
  return LeaseGrant{resp.lease_id(), resp.ttl_ms()};
}

absl::StatusOr<int64_t> Client::KeepAlive(uint64_t lease_id, double timeout_s,
                                          grpc::ClientContext* context) {
  grpc::ClientContext own;
  grpc::ClientContext& ctx = context != nullptr ? *context : own;
  PrepareContext(&ctx);
  if (timeout_s > 0) ctx.set_deadline(DeadlineIn(timeout_s));
  v1::KeepAliveRequest req;
  req.set_lease_id(lease_id);
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  v1::KeepAliveResponse resp;
  grpc::Status s = stub_->KeepAlive(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp.ttl_ms();
}

absl::StatusOr<v1::Holdings> Client::RevokeLease(uint64_t lease_id) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::RevokeLeaseRequest req;
  req.set_lease_id(lease_id);
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  v1::RevokeLeaseResponse resp;
  grpc::Status s = stub_->RevokeLease(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return std::move(*resp.mutable_released());
}

absl::StatusOr<v1::ListHoldingsResponse> Client::ListHoldings(uint64_t lease_id) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ListHoldingsRequest req;
  req.set_lease_id(lease_id);
  v1::ListHoldingsResponse resp;
  grpc::Status s = stub_->ListHoldings(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::StatusOr<v1::Holdings> Client::ReleaseHoldings() {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ReleaseHoldingsRequest req;
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  v1::ReleaseHoldingsResponse resp;
  grpc::Status s = stub_->ReleaseHoldings(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return std::move(*resp.mutable_released());
}

absl::Status Client::Health(const std::string& service) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  if (options_.timeout_s <= 0) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = health->Check(&ctx, req, &resp);
  if (const std::string cause = ConnectCause(s, options_); !cause.empty()) {
    return absl::UnavailableError(cause);
  }
  if (!s.ok()) return FromGrpc(s);
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat("health of '", service, "' is ",
                                               grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
