#include "server/grpc/attention_service.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "spdlog/spdlog.h"
#include "server/grpc/convert.h"
#include "server/grpc/status_mapping.h"

namespace attnserve {
namespace {

// Requests kept for reuse, and the most buffer capacity they may hold: enough
// for 256 in-flight decode requests of 64 sequences. (Their tensors' data is
// read in place, never into the message: what they keep is the layout's
// arrays.)
constexpr size_t kPooledPrefillRequests = 256;
constexpr int64_t kPooledPrefillBytes = int64_t{256} << 20;

// The incarnation a request expects, for the requests that carry one.
template <typename Request>
auto ExpectedIncarnation(const Request& r, int) -> decltype(uint64_t{r.expected_incarnation()}) {
  return r.expected_incarnation();
}
template <typename Request>
uint64_t ExpectedIncarnation(const Request&, long) {
  return 0;  // GetServerInfo, MergeStates: not checked
}

// The lease a request names, for the requests that carry one.
template <typename Request>
auto LeaseId(const Request& r, int) -> decltype(uint64_t{r.lease_id()}) {
  return r.lease_id();
}
template <typename Request>
uint64_t LeaseId(const Request&, long) {
  return 0;
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(AttentionCore* core, const TokenAuth* auth,
                                           Metrics* metrics, ServiceOptions options)
    : core_(core),
      auth_(auth),
      metrics_(metrics),
      access_log_(options.access_log),
      read_timeout_(options.read_timeout),
      limits_(core->limits().max_request_rows, core->limits().max_request_kv_indices,
              core->geometry().num_pages, kMaxMergeStates, core->geometry().num_qo_heads,
              core->geometry().num_layers, core->geometry().num_kv_heads),
      prefill_requests_(kPooledPrefillRequests, kPooledPrefillBytes,
                        [](v1::PrefillRequest* r) { return ResetForReuse(r); }) {
  options.channels.access_log = options.access_log;
  channels_ = std::make_unique<ChannelServer>(core, metrics, &limits_, &prefill_requests_,
                                              options.channels);
  RegisterMethods();
  sweeper_ = std::thread([this] { SweepReads(); });
}

// One RPC: its reactor. Created when the call's metadata arrives, it admits
// the call (not draining, a valid token) and only then reads
// the request, within the read timeout; the method's handler then parses
// it against its wire limits. The call is finished exactly once, by whoever
// claims it first: the admission, the read, the handler (errors found at
// once), the core's done callback, the read timeout or AbandonInflight. It
// is deleted when gRPC is done with it and nothing else holds a reference.
class AttentionServiceImpl::Call final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Call(AttentionServiceImpl* service, grpc::CallbackServerContext* ctx, Metrics::Rpc rpc,
       Handler handler)
      : service_(service),
        ctx_(ctx),
        rpc_(rpc),
        handler_(handler),
        request_id_(service->next_request_id_++),
        start_(absl::Now()),
        // A Prefill refused before its body is read counts as a prefill.
        shape_(rpc == Metrics::Rpc::kPrefill ? Metrics::Shape::kPrefill : Metrics::Shape::kNone) {
    service_->metrics_->inflight().Increment();
    absl::MutexLock lock(&service_->calls_mu_);
    service_->calls_.insert(this);
  }

  // Admission, from the metadata alone; then the request is read. A call
  // refused here is finished without a byte of its body accepted.
  void Start() {
    if (service_->draining_) {
      FinishNow(absl::UnavailableError("server is draining"));
      return;
    }
    accepted_ = true;
    ++service_->accepted_inflight_;
    absl::string_view authorization;
    auto it = ctx_->client_metadata().find("authorization");
    if (it != ctx_->client_metadata().end()) {
      authorization = absl::string_view(it->second.data(), it->second.size());
    }
    auto tenant = service_->auth_->Authenticate(authorization);
    if (!tenant.ok()) {
      FinishNow(tenant.status());
      return;
    }
    tenant_ = *std::move(tenant);
    // From now on SweepReads cuts the call off if its request has not
    // arrived within the read timeout.
    reading_.store(true, std::memory_order_release);
    StartRead(&request_);
  }

  // True when the call's request is still being read at `now`, past the
  // read timeout (SweepReads then finishes it).
  bool ReadOverdue(absl::Time now) const {
    return reading_.load(std::memory_order_acquire) &&
           !read_done_.load(std::memory_order_acquire) && now >= start_ + service_->read_timeout_;
  }
  void FinishReadOverdue() {
    if (read_done_.load(std::memory_order_acquire)) return;
    FinishNow(absl::DeadlineExceededError(absl::StrCat(
        "the request did not arrive within ", absl::FormatDuration(service_->read_timeout_),
        " of the call's start (--request_read_timeout_s): a slow or stalled sender")));
  }

  void OnReadDone(bool ok) override {
    read_done_.store(true, std::memory_order_release);
    if (!ok) {
      // No message: the client gave up (or its deadline passed) while
      // sending, or half-closed without one, or sent more than
      // --max_message_bytes (gRPC then ends the call itself).
      absl::Status status = ctx_->IsCancelled()
                                ? Abandoned("while the request arrived")
                                : absl::InvalidArgumentError("the call carried no request message");
      FinishNow(status);
      return;
    }
    bytes_in_ = static_cast<int64_t>(request_.Length());
    // gRPC lets messages of up to 2 GiB through (AttnServer): the limit is
    // checked here, in words that name the flag and the way around it.
    const int64_t max_bytes = service_->core_->limits().max_message_bytes;
    if (bytes_in_ > max_bytes) {
      FinishNow(absl::ResourceExhaustedError(absl::StrCat(
          "the request is ", bytes_in_, " bytes, more than --max_message_bytes=", max_bytes,
          ": send tensors this large through a shared-memory region (docs/transport.md; the "
          "server needs --allow_shared_memory), or split the request")));
      return;
    }
    (service_->*handler_)(this);
  }

  // Parses the request into `message` after checking it against `limits`;
  // with `tensors`, the data of the Tensor fields `in_place` stays in gRPC's
  // slices, which *tensors then holds (ParseInto in convert.h). False when
  // it does not fit or parse (the call is finished with INVALID_ARGUMENT).
  bool Parse(const WireMessage& limits, google::protobuf::MessageLite* message,
             absl::Span<const uint32_t> in_place = {}, InPlaceTensors* tensors = nullptr) {
    absl::Status status = tensors != nullptr
                              ? ParseInto(request_, limits, in_place, message, tensors)
                              : ParseInto(request_, limits, message);
    if (status.ok()) {
      // The buffer goes at once, not when the call ends: the parsed message
      // holds the small fields, and a tensor read in place keeps the slices
      // it lies in through *tensors, not through the buffer. A request so
      // costs about its size until its call ends (its tensors' bytes in the
      // slices), plus its output: never a second copy of it.
      request_.Clear();
      return true;
    }
    FinishNow(status);
    return false;
  }

  // What every handler does first: parses the request into `parsed` (and
  // *tensors, as Parse does) and fills the core's CallContext (tenant,
  // deadline, cancellation, request id, the expected incarnation and the
  // lease where the request has them; `c` may be null). False when the call
  // is finished (the request does not parse): the handler returns then.
  template <typename Request>
  bool Open(const WireMessage& limits, Request* parsed, CallContext* c,
            absl::Span<const uint32_t> in_place = {}, InPlaceTensors* tensors = nullptr) {
    if (finished() || !Parse(limits, parsed, in_place, tensors)) return false;
    if (c != nullptr) {
      Bind(c);
      c->expected_incarnation = ExpectedIncarnation(*parsed, 0);
      c->lease_id = LeaseId(*parsed, 0);
    }
    return true;
  }

  // Fills the caller's context of a core call.
  void Bind(CallContext* c) {
    c->tenant = tenant_;
    c->request_id = request_id_;
    c->message_bytes = bytes_in_;  // gRPC's slices, held until the call is answered
    const auto deadline = ctx_->deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      c->deadline = absl::FromChrono(deadline);
    }
    // The reactor, not gRPC's context: the core's done callback holds a
    // reference to the reactor until it has run, while the context may go
    // once the call is done (a call answered by the drain, say).
    c->is_cancelled = [this] { return given_up(); };
    // The response's bytes stay held until gRPC has written it out (a
    // large one, OnWriteDone) or the call is deleted (after gRPC's OnDone
    // and the core's answer).
    c->hold_response = [this](std::function<void()> release) { release_held_ = std::move(release); };
  }

  // The call will not be answered with the core's result: its client gave
  // up (OnCancel), or it was answered already (the drain's abandonment).
  bool given_up() const {
    return cancelled_.load(std::memory_order_acquire) || finished();
  }

  void set_shape(Metrics::Shape shape) { shape_ = shape; }
  const std::string& tenant() const { return tenant_; }

  // The core's done callback holds a reference until it has run.
  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  // The first caller wins and must then call Finish; later callers must not
  // touch the response.
  bool Claim() { return !claimed_.exchange(true, std::memory_order_acq_rel); }

  // Finishes a claimed call. On OK the response is `message` serialized, or
  // `bytes` when message is null.
  void Finish(absl::Status status, const google::protobuf::Message* message = nullptr,
              grpc::ByteBuffer* bytes = nullptr) {
    int64_t bytes_out = 0;
    if (status.ok()) {
      if (message != nullptr) {
        bool own = false;
        grpc::Status s = grpc::SerializationTraits<google::protobuf::Message>::Serialize(
            *message, &response_, &own);
        if (!s.ok()) status = absl::InternalError("cannot serialize the response");
      } else if (bytes != nullptr) {
        response_.Swap(bytes);
      }
      bytes_out = status.ok() ? static_cast<int64_t>(response_.Length()) : 0;
    }
    // A call the client has given up on (its deadline passed, or it
    // cancelled) gets no response: it counts as what the client saw.
    if (ctx_->IsCancelled()) {
      status = Abandoned("before its answer was ready");
      bytes_out = 0;
    }
    grpc::Status grpc_status = ToGrpcStatus(status);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start_);
    Metrics* metrics = service_->metrics_;
    metrics->ObserveRequest(rpc_, static_cast<absl::StatusCode>(grpc_status.error_code()),
                            shape_, seconds);
    metrics->AddTransferBytes(bytes_in_, bytes_out);
    metrics->inflight().Decrement();
    if (accepted_) {
      service_->last_accepted_finish_ns_ = absl::GetCurrentTimeNanos();
      --service_->accepted_inflight_;
    }
    if (service_->access_log_) {
      spdlog::info(
          "access method={} tenant={} peer={} request_id={} code={} seconds={:.6f} bytes_in={} "
          "bytes_out={} error=\"{}\"",
          Metrics::RpcName(rpc_), tenant_.empty() ? "-" : tenant_, ctx_->peer(), request_id_,
          GrpcCodeName(grpc_status.error_code()), seconds, bytes_in_, bytes_out,
          grpc_status.error_message());
    }
    finished_at_ = absl::Now();
    if (grpc_status.ok() && response_.Length() >= kSplitWriteBytes) {
      // The response's held bytes go back once gRPC has written it out
      // (OnWriteDone), not when the call is deleted after its status: a
      // client that sends its next request on this answer must find them
      // back. A client that reads nothing never lets the write complete.
      StartWrite(&response_);
    } else if (grpc_status.ok()) {
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc_status);
    } else {
      ServerBidiReactor::Finish(grpc_status);
    }
  }

  // A large response's write has completed (or the stream broke): its held
  // bytes go back, then the status follows.
  void OnWriteDone(bool /*ok*/) override {
    if (release_held_) std::exchange(release_held_, nullptr)();
    response_.Clear();
    ServerBidiReactor::Finish(grpc::Status::OK);
  }

  // Request stages (Metrics::RequestStage) of a Prefill: the time since the
  // previous mark.
  void MarkStage(Metrics::RequestStage stage) {
    const absl::Time now = absl::Now();
    service_->metrics_->ObserveRequestStage(stage, absl::ToDoubleSeconds(now - last_mark_));
    last_mark_ = now;
  }
  // The respond stage: from the core's done callback (at `done_at`) to now.
  void ObserveRespond(absl::Time done_at) {
    service_->metrics_->ObserveRequestStage(Metrics::RequestStage::kRespond,
                                            absl::ToDoubleSeconds(absl::Now() - done_at));
  }

  // Claims and finishes at once (errors found by the handler).
  void FinishNow(const absl::Status& status) {
    if (Claim()) Finish(status);
  }

  bool finished() const { return claimed_.load(std::memory_order_acquire); }

  void OnCancel() override {
    cancelled_.store(true, std::memory_order_release);
    // Queued work leaves the queue now, answered as the client saw it end;
    // the core then finishes the call.
    if (!finished() && !tenant_.empty()) {
      service_->core_->Cancel(tenant_, request_id_, Abandoned("while queued"));
    }
  }

  // Why a cancelled call ended: its deadline passed, or the client cancelled.
  // A client whose deadline passes cancels the call itself, and the server's
  // copy of the deadline (the client's timeout from the call's arrival) is
  // later by the request's travel: a cancel within kDeadlineSlack of it is
  // the deadline's.
  absl::Status Abandoned(absl::string_view when) const {
    constexpr auto kDeadlineSlack = std::chrono::milliseconds(100);
    return ctx_->deadline() <= std::chrono::system_clock::now() + kDeadlineSlack
               ? absl::DeadlineExceededError(absl::StrCat("the call's deadline passed ", when))
               : absl::CancelledError(absl::StrCat("request cancelled by the client ", when));
  }

  ~Call() override {
    if (release_held_) release_held_();
  }

  void OnDone() override {
    if (rpc_ == Metrics::Rpc::kPrefill && finished_at_ != absl::InfinitePast()) {
      service_->metrics_->ObserveRequestStage(Metrics::RequestStage::kSend,
                                              absl::ToDoubleSeconds(absl::Now() - finished_at_));
    }
    {
      absl::MutexLock lock(&service_->calls_mu_);
      service_->calls_.erase(this);
    }
    Unref();
  }

 private:
  AttentionServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  const Metrics::Rpc rpc_;
  const Handler handler_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  // The scheduler's release of the response's bytes (CallContext::
  // hold_response): run once a response of kSplitWriteBytes or more has
  // been written out (OnWriteDone), else when the call is deleted. Set on
  // the scheduler's finisher while the core's done callback holds a
  // reference.
  std::function<void()> release_held_;
  // Responses this large are written, then finished (two gRPC operations
  // instead of one, which costs a smaller response more than it gains).
  static constexpr size_t kSplitWriteBytes = 64 << 10;
  const uint64_t request_id_;
  int64_t bytes_in_ = 0;
  const absl::Time start_;
  absl::Time last_mark_ = start_;                     // MarkStage's previous mark
  absl::Time finished_at_ = absl::InfinitePast();     // when Finish handed the response to gRPC
  std::string tenant_;
  Metrics::Shape shape_;
  bool accepted_ = false;  // arrived before the drain began
  std::atomic<bool> reading_{false};  // admitted, its request being read
  std::atomic<bool> read_done_{false};
  std::atomic<bool> claimed_{false};
  std::atomic<bool> cancelled_{false};  // OnCancel has run
  std::atomic<int> refs_{1};  // gRPC's, until OnDone
};

void AttentionServiceImpl::RegisterMethods() {
  using R = Metrics::Rpc;
  using S = AttentionServiceImpl;
  const std::pair<R, Handler> methods[] = {
      {R::kGetServerInfo, &S::GetServerInfo}, {R::kAllocatePages, &S::AllocatePages},
      {R::kFreePages, &S::FreePages},         {R::kWriteKV, &S::WriteKV},
      {R::kReadKV, &S::ReadKV},               {R::kPrefill, &S::Prefill},
      {R::kMergeStates, &S::MergeStates},     {R::kCreatePlan, &S::CreatePlan},
      {R::kReleasePlan, &S::ReleasePlan},     {R::kRegisterRegion, &S::RegisterRegion},
      {R::kUnregisterRegion, &S::UnregisterRegion}, {R::kListRegions, &S::ListRegions},
      {R::kOpenChannel, &S::OpenChannel},     {R::kCloseChannel, &S::CloseChannel},
      {R::kGrantLease, &S::GrantLease},       {R::kKeepAlive, &S::KeepAlive},
      {R::kRevokeLease, &S::RevokeLease},     {R::kListHoldings, &S::ListHoldings},
      {R::kReleaseHoldings, &S::ReleaseHoldings}, {R::kSetKvScales, &S::SetKvScales},
      {R::kGetKvScales, &S::GetKvScales},
  };
  static_assert(sizeof(methods) / sizeof(methods[0]) == static_cast<size_t>(R::kCount));
  method_names_.reserve(std::size(methods));  // gRPC keeps pointers into them
  int index = 0;
  for (const auto& [rpc, handler] : methods) {
    method_names_.push_back(absl::StrCat("/", kServiceName, "/", Metrics::RpcName(rpc)));
    AddMethod(new grpc::internal::RpcServiceMethod(method_names_.back().c_str(),
                                                   grpc::internal::RpcMethod::BIDI_STREAMING,
                                                   nullptr));
    MarkMethodRawCallback(
        index++, new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                     [this, rpc = rpc, handler = handler](grpc::CallbackServerContext* ctx) {
                       auto* call = new Call(this, ctx, rpc, handler);
                       call->Start();
                       return call;
                     }));
  }
}

AttentionServiceImpl::~AttentionServiceImpl() {
  {
    absl::MutexLock lock(&sweep_mu_);
    sweep_stop_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
}

void AttentionServiceImpl::SweepReads() {
  // Ten looks per timeout, at most every 100 ms: a stalled sender is cut off
  // within a tenth of the timeout (or 100 ms) after it.
  const absl::Duration tick =
      std::clamp(read_timeout_ / 10, absl::Milliseconds(1), absl::Milliseconds(100));
  absl::MutexLock stop_lock(&sweep_mu_);
  while (!sweep_mu_.AwaitWithTimeout(absl::Condition(&sweep_stop_), tick)) {
    const absl::Time now = absl::Now();
    std::vector<Call*> overdue;
    {
      absl::MutexLock lock(&calls_mu_);
      for (Call* call : calls_) {
        if (call->ReadOverdue(now)) {
          call->Ref();  // alive until finished here, whoever finishes first
          overdue.push_back(call);
        }
      }
    }
    if (overdue.empty()) continue;
    sweep_mu_.Unlock();
    for (Call* call : overdue) {
      call->FinishReadOverdue();
      call->Unref();
    }
    sweep_mu_.Lock();
  }
}

int AttentionServiceImpl::AbandonInflight(const absl::Status& status) {
  std::vector<Call*> calls;
  {
    absl::MutexLock lock(&calls_mu_);
    for (Call* call : calls_) {
      call->Ref();  // alive until we are done with it, whoever finishes first
      calls.push_back(call);
    }
  }
  int abandoned = channels_->AbandonInflight(status);
  for (Call* call : calls) {
    if (call->Claim()) {
      call->Finish(status);
      ++abandoned;
    }
    call->Unref();
  }
  return abandoned;
}

void AttentionServiceImpl::GetServerInfo(Call* call) {
  v1::GetServerInfoRequest parsed;
  if (!call->Open(limits_.get_server_info, &parsed, nullptr)) return;
  const ServerInfoData info = core_->Info();
  v1::ServerInfo out;
  out.set_version(info.version);
  out.set_backend(info.backend);
  out.set_device(info.device);
  out.set_num_layers(info.num_layers);
  out.set_num_pages(info.num_pages);
  out.set_page_size(info.page_size);
  out.set_num_qo_heads(info.num_qo_heads);
  out.set_num_kv_heads(info.num_kv_heads);
  out.set_head_dim(info.head_dim);
  out.set_attention(info.attention == AttentionKind::kMla ? v1::ATTENTION_MLA : v1::ATTENTION_GQA);
  out.set_qk_head_dim(info.head_dim);
  out.set_v_head_dim(info.v_head_dim);
  out.set_kv_lora_rank(info.kv_lora_rank);
  out.set_qk_rope_head_dim(info.qk_rope_head_dim);
  out.set_kv_dtype(info.kv_fp8 != Fp8Format::kNone ? ToProto(TensorDTypeOf(info.kv_fp8))
                                                   : ToProto(info.kv_dtype));
  out.set_q_dtype(ToProto(info.kv_dtype));
  out.set_kv_cache_bytes(info.kv_cache_bytes);
  out.set_page_bytes(info.page_bytes);
  out.set_free_pages(info.free_pages);
  out.set_max_batch_tokens(info.max_batch_tokens);
  out.set_max_message_bytes(info.max_message_bytes);
  out.set_incarnation(info.incarnation);
  out.set_lease_default_ttl_ms(info.lease_default_ttl_ms);
  out.set_lease_max_ttl_ms(info.lease_max_ttl_ms);
  {
    absl::MutexLock lock(&region_socket_mu_);
    out.set_region_socket(region_socket_);
  }
  if (call->Claim()) call->Finish(absl::OkStatus(), &out);
}

void AttentionServiceImpl::AllocatePages(Call* call) {
  v1::AllocatePagesRequest parsed;
  CallContext c;
  if (!call->Open(limits_.allocate_pages, &parsed, &c)) return;
  auto pages = core_->AllocatePages(c, parsed.count());
  v1::AllocatePagesResponse out;
  if (pages.ok()) {
    out.mutable_page_ids()->Assign(pages->begin(), pages->end());
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(pages.status(), &out);
}

void AttentionServiceImpl::FreePages(Call* call) {
  auto parsed = std::make_shared<v1::FreePagesRequest>();
  CallContext c;
  if (!call->Open(limits_.free_pages, parsed.get(), &c)) return;
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->FreePages(c,
                   absl::MakeConstSpan(parsed->page_ids().data(),
                                       static_cast<size_t>(parsed->page_ids_size())),
                   [call, parsed, incarnation](absl::Status status) {
                     if (call->Claim()) {
                       v1::FreePagesResponse out;
                       out.set_incarnation(incarnation);
                       call->Finish(status, &out);
                     }
                     call->Unref();
                   });
}

void AttentionServiceImpl::WriteKV(Call* call) {
  // The request, and its k and v data left in gRPC's slices, until the
  // core is done with them.
  struct State {
    v1::WriteKVRequest request;
    InPlaceTensors tensors;
  };
  auto state = std::make_shared<State>();
  WriteKvCall c;
  if (!call->Open(limits_.write_kv, &state->request, &c, kWriteKvInPlace, &state->tensors)) {
    return;
  }
  ToCall(state->request, state->tensors, &c);
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->WriteKv(c, [call, state, incarnation](absl::Status status) {
    if (call->Claim()) {
      v1::WriteKVResponse out;
      out.set_incarnation(incarnation);
      call->Finish(status, &out);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::ReadKV(Call* call) {
  struct State {
    v1::ReadKVRequest request;
    // The backend writes the rows into its k and v data; sent from there.
    std::unique_ptr<v1::ReadKVResponse> response = std::make_unique<v1::ReadKVResponse>();
    TensorDType dtype = TensorDType::kUnspecified;  // of the rows, set by the core
  };
  auto state = std::make_shared<State>();
  ReadKvCall c;
  if (!call->Open(limits_.read_kv, &state->request, &c)) return;
  ToCall(state->request, state->response.get(), &c);
  c.out_dtype = &state->dtype;
  const KvGeometry& g = core_->geometry();
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->ReadKv(c, [call, state, g, incarnation](absl::Status status) {
    if (call->Claim()) {
      grpc::ByteBuffer bytes;
      if (status.ok()) {
        v1::ReadKVResponse& out = *state->response;
        const v1::DType dtype = ToProto(state->dtype);
        const int64_t n = state->request.slots_size();
        SetTensorHeader(out.mutable_k(), dtype, {n, g.num_kv_heads, g.head_dim});
        if (g.HasVPool()) SetTensorHeader(out.mutable_v(), dtype, {n, g.num_kv_heads, g.head_dim});
        out.set_incarnation(incarnation);
        bytes = EncodeTensorResponse(std::move(state->response));
      }
      call->Finish(status, nullptr, &bytes);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::Prefill(Call* call) {
  // What the request and its output need until the response is encoded:
  // the request's small fields, its tensors' data (left in gRPC's slices)
  // and the output.
  struct State {
    RecyclingPool<v1::PrefillRequest>::Ptr request;
    InPlaceTensors tensors;
    PrefillOutput out;
  };
  auto* state = new State{prefill_requests_.Get(), {}, {}};
  PrefillCall c;
  if (!call->Open(limits_.prefill, state->request.get(), &c, kPrefillInPlace, &state->tensors)) {
    delete state;
    return;
  }
  const v1::PrefillRequest& parsed = *state->request;
  call->set_shape(PrefillShape(parsed));
  ToCall(parsed, state->tensors, &c);
  c.out = &state->out;
  const uint64_t incarnation = core_->incarnation();
  call->MarkStage(Metrics::RequestStage::kParse);
  call->Ref();
  // The done callback may run before Prefill returns (an error found at
  // once, or a batch that finished first): the admit mark is taken before
  // the call can be finished, under the reference held for the callback.
  call->Ref();
  core_->Prefill(c, [call, state, incarnation](absl::Status status) {
    if (call->Claim()) {
      const absl::Time done_at = absl::Now();
      if (state->out.max_seq_q_rows >= 0) call->set_shape(ShapeOfRows(state->out.max_seq_q_rows));
      grpc::ByteBuffer bytes;
      if (status.ok()) bytes = EncodePrefillResponse(std::move(state->out), incarnation);
      call->ObserveRespond(done_at);
      call->Finish(status, nullptr, &bytes);
      // Only then does the request go back to the pool and its slices to
      // gRPC (the output lives in `bytes`): releasing a large request's
      // slices took milliseconds, which the response no longer waits for.
      delete state;
    } else {
      delete state;
    }
    call->Unref();
  });
  call->MarkStage(Metrics::RequestStage::kAdmit);
  call->Unref();
}

void AttentionServiceImpl::MergeStates(Call* call) {
  struct State {
    v1::MergeStatesRequest request;
    // The backend writes the merged state into its v and lse data.
    std::unique_ptr<v1::MergeStatesResponse> response =
        std::make_unique<v1::MergeStatesResponse>();
  };
  auto state = std::make_shared<State>();
  MergeStatesCall c;
  if (!call->Open(limits_.merge_states, &state->request, &c)) return;
  ToCall(state->request, state->response.get(), &c);
  std::vector<int64_t> shape;
  if (!c.v.empty()) shape = c.v[0].shape;  // validated rank 3 when the merge succeeds
  const v1::DType dtype = ToProto(core_->geometry().dtype);
  const uint64_t incarnation = core_->incarnation();
  call->Ref();
  core_->MergeStates(c, [call, state, dtype, shape, incarnation](absl::Status status) {
    if (call->Claim()) {
      grpc::ByteBuffer bytes;
      if (status.ok()) {
        v1::MergeStatesResponse& out = *state->response;
        SetTensorHeader(out.mutable_v(), dtype, shape);
        SetTensorHeader(out.mutable_lse(), v1::DTYPE_FP32, absl::MakeConstSpan(shape.data(), 2));
        out.set_incarnation(incarnation);
        bytes = EncodeTensorResponse(std::move(state->response));
      }
      call->Finish(status, nullptr, &bytes);
    }
    call->Unref();
  });
}

}  // namespace attnserve

namespace attnserve {

void AttentionServiceImpl::CreatePlan(Call* call) {
  v1::CreatePlanRequest parsed;
  CallContext c;
  if (!call->Open(limits_.create_plan, &parsed, &c)) return;
  auto id = core_->CreatePlan(c, ToLayout(parsed), ToPlanOptions(parsed));
  v1::CreatePlanResponse out;
  if (id.ok()) {
    out.set_plan_id(*id);
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(id.status(), &out);
}

void AttentionServiceImpl::ReleasePlan(Call* call) {
  v1::ReleasePlanRequest parsed;
  CallContext c;
  if (!call->Open(limits_.release_plan, &parsed, &c)) return;
  const absl::Status status = core_->ReleasePlan(c, parsed.plan_id());
  v1::ReleasePlanResponse out;
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(status, &out);
}

void AttentionServiceImpl::RegisterRegion(Call* call) {
  v1::RegisterRegionRequest parsed;
  if (!call->Parse(limits_.register_region, &parsed)) return;
  CallContext c;
  call->Bind(&c);
  c.lease_id = parsed.lease_id();
  const absl::Status status = core_->RegisterRegion(c, ToSpec(parsed));
  v1::RegisterRegionResponse out;
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(status, &out);
}

void AttentionServiceImpl::UnregisterRegion(Call* call) {
  v1::UnregisterRegionRequest parsed;
  if (!call->Parse(limits_.unregister_region, &parsed)) return;
  CallContext c;
  call->Bind(&c);
  const absl::Status status = core_->UnregisterRegion(c, parsed.name());
  v1::UnregisterRegionResponse out;
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(status, &out);
}

void AttentionServiceImpl::ListRegions(Call* call) {
  v1::ListRegionsRequest parsed;
  if (!call->Parse(limits_.list_regions, &parsed)) return;
  CallContext c;
  call->Bind(&c);
  v1::ListRegionsResponse out;
  for (const RegionInfoData& info : core_->ListRegions(c)) ToProto(info, out.add_regions());
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(absl::OkStatus(), &out);
}

void AttentionServiceImpl::OpenChannel(Call* call) {
  v1::OpenChannelRequest parsed;
  CallContext c;
  if (!call->Open(limits_.open_channel, &parsed, &c)) return;
  auto opened = channels_->Open(c, ToRingRef(parsed));
  v1::OpenChannelResponse out;
  if (opened.ok()) {
    out.set_channel_id(opened->id);
    out.set_slot_count(static_cast<uint32_t>(opened->slot_count));
    out.set_slot_bytes(static_cast<uint32_t>(opened->slot_bytes));
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(opened.status(), &out);
}

void AttentionServiceImpl::CloseChannel(Call* call) {
  v1::CloseChannelRequest parsed;
  CallContext c;
  if (!call->Open(limits_.close_channel, &parsed, &c)) return;
  const absl::Status status = channels_->Close(c, parsed.channel_id());
  v1::CloseChannelResponse out;
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(status, &out);
}

namespace {

void ToProto(const HoldingsData& h, v1::Holdings* out) {
  out->mutable_page_ids()->Assign(h.pages.begin(), h.pages.end());
  out->mutable_plan_ids()->Assign(h.plans.begin(), h.plans.end());
  for (const std::string& name : h.regions) out->add_region_names(name);
  out->mutable_channel_ids()->Assign(h.channels.begin(), h.channels.end());
}

}  // namespace

void AttentionServiceImpl::GrantLease(Call* call) {
  v1::GrantLeaseRequest parsed;
  CallContext c;
  if (!call->Open(limits_.grant_lease, &parsed, &c)) return;
  auto granted = core_->GrantLease(c, parsed.ttl_ms());
  v1::GrantLeaseResponse out;
  if (granted.ok()) {
    out.set_lease_id(granted->id);
    out.set_ttl_ms(absl::ToInt64Milliseconds(granted->ttl));
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(granted.status(), &out);
}

void AttentionServiceImpl::KeepAlive(Call* call) {
  v1::KeepAliveRequest parsed;
  CallContext c;
  if (!call->Open(limits_.keep_alive, &parsed, &c)) return;
  auto ttl = core_->KeepAlive(c, parsed.lease_id());
  v1::KeepAliveResponse out;
  if (ttl.ok()) {
    out.set_ttl_ms(*ttl);
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(ttl.status(), &out);
}

void AttentionServiceImpl::RevokeLease(Call* call) {
  v1::RevokeLeaseRequest parsed;
  CallContext c;
  if (!call->Open(limits_.revoke_lease, &parsed, &c)) return;
  // Answered once the pages it freed are zeroed (AttentionCore::RevokeLease).
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->RevokeLease(c, parsed.lease_id(), [call, incarnation](absl::StatusOr<HoldingsData> released) {
    if (call->Claim()) {
      v1::RevokeLeaseResponse out;
      if (released.ok()) {
        ToProto(*released, out.mutable_released());
        out.set_incarnation(incarnation);
      }
      call->Finish(released.status(), &out);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::ListHoldings(Call* call) {
  v1::ListHoldingsRequest parsed;
  CallContext c;
  if (!call->Open(limits_.list_holdings, &parsed, &c)) return;
  auto held = core_->ListHoldings(c, parsed.lease_id());
  v1::ListHoldingsResponse out;
  if (held.ok()) {
    for (const LeaseData& l : held->leases) {
      v1::LeaseInfo* info = out.add_leases();
      info->set_lease_id(l.id);
      info->set_ttl_ms(l.ttl_ms);
      info->set_remaining_ms(l.remaining_ms);
      ToProto(l.holdings, info->mutable_holdings());
    }
    ToProto(held->unleased, out.mutable_unleased());
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(held.status(), &out);
}

void AttentionServiceImpl::ReleaseHoldings(Call* call) {
  v1::ReleaseHoldingsRequest parsed;
  CallContext c;
  if (!call->Open(limits_.release_holdings, &parsed, &c)) return;
  // Answered once the pages it freed are zeroed (AttentionCore::RevokeLease).
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->ReleaseHoldings(c, [call, incarnation](absl::StatusOr<HoldingsData> released) {
    if (call->Claim()) {
      v1::ReleaseHoldingsResponse out;
      if (released.ok()) {
        ToProto(*released, out.mutable_released());
        out.set_incarnation(incarnation);
      }
      call->Finish(released.status(), &out);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::SetKvScales(Call* call) {
  auto parsed = std::make_shared<v1::SetKvScalesRequest>();
  CallContext context;
  if (!call->Open(limits_.set_kv_scales, parsed.get(), &context)) return;
  SetKvScalesCall c = ToCall(*parsed);  // views `parsed`, which the callback keeps
  static_cast<CallContext&>(c) = context;
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->SetKvScales(c, [call, parsed, incarnation](absl::Status status) {
    if (call->Claim()) {
      v1::SetKvScalesResponse out;
      out.set_incarnation(incarnation);
      call->Finish(status, &out);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::GetKvScales(Call* call) {
  v1::GetKvScalesRequest parsed;
  if (!call->Open(limits_.get_kv_scales, &parsed, nullptr)) return;
  v1::GetKvScalesResponse out;
  for (const LayerScales& l : core_->KvScales()) {
    v1::LayerKvScales* m = out.add_layers();
    m->set_layer(l.layer);
    m->mutable_k_scale()->Assign(l.k_scale.begin(), l.k_scale.end());
    m->mutable_v_scale()->Assign(l.v_scale.begin(), l.v_scale.end());
  }
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(absl::OkStatus(), &out);
}

}  // namespace attnserve
