// AttentionServiceImpl::Call, one RPC's reactor, as the service's handler
// files (attention_service.cc, attention_service_resources.cc) use it.
// Included by those files only.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "spdlog/spdlog.h"
#include "server/grpc/attention_service.h"
#include "server/grpc/convert.h"
#include "server/grpc/status_mapping.h"

namespace attnserve {
namespace service_internal {

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

}  // namespace service_internal

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
      c->expected_incarnation = service_internal::ExpectedIncarnation(*parsed, 0);
      c->lease_id = service_internal::LeaseId(*parsed, 0);
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

}  // namespace attnserve
