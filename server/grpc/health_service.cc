// grpc.health.v1.Health on the server's port (server/grpc/health_service.h).
#include "server/grpc/health_service.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/grpc/attention_service.h"  // kServiceName

namespace attnserve {
namespace {

using grpc::health::v1::HealthCheckResponse;

grpc::ByteBuffer Serialized(HealthCheckResponse::ServingStatus status) {
  HealthCheckResponse response;
  response.set_status(status);
  const std::string bytes = response.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace

// One Check or Watch. Alive until gRPC is done with it (OnDone) and no
// sweep or status change holds it (refs_).
class HealthService::Call : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Call(HealthService* service, bool watch, std::string peer)
      : service_(service), watch_(watch), peer_(std::move(peer)), start_(absl::Now()) {}

  void Start() {
    std::optional<grpc::Status> refused;
    {
      absl::MutexLock lock(&service_->mu_);
      if (service_->shut_down_) {
        refused = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
      } else if (service_->reading_ >= kMaxReading) {
        refused = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                               absl::StrCat("more than ", kMaxReading,
                                            " health calls are waiting for their requests: try again"));
      } else {
        reading_ = true;
        ++service_->reading_;
        service_->calls_.insert(this);
      }
    }
    if (refused.has_value()) {
      TryFinish(*refused);
      return;
    }
    service_->sweeper_->Wake();
    StartRead(&request_);
  }

  // Whether the request is overdue (under the service's mu_).
  bool ReadOverdue(absl::Time now, absl::Duration timeout) const { return reading_ && now >= start_ + timeout; }
  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  void OnReadDone(bool ok) override {
    DoneReading();
    if (!ok) {
      TryFinish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no HealthCheckRequest"));
      return;
    }
    if (static_cast<int64_t>(request_.Length()) > kMaxRequestBytes) {
      TryFinish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                             absl::StrCat("a HealthCheckRequest of ", request_.Length(), " bytes: at most ",
                                          kMaxRequestBytes)));
      return;
    }
    std::vector<grpc::Slice> slices;
    std::string bytes;
    if (request_.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    grpc::health::v1::HealthCheckRequest request;
    if (!request.ParseFromString(bytes)) {
      TryFinish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a HealthCheckRequest that does not parse"));
      return;
    }
    known_ = request.service().empty() || request.service() == kServiceName;
    if (!watch_) {
      if (!known_) {
        TryFinish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                               absl::StrCat("unknown service '", request.service(), "' (this server serves '",
                                            kServiceName, "' and '')")));
        return;
      }
      const HealthCheckResponse::ServingStatus status = Status();
      absl::MutexLock lock(&write_mu_);
      if (finished_) return;
      finished_ = true;
      response_ = Serialized(status);
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
      return;
    }
    if (std::optional<grpc::Status> refused = StartWatching(); refused.has_value()) {
      TryFinish(*refused);
      return;
    }
    Notify();
  }

  // Watch: sends the status when it differs from the last one sent.
  void Notify() {
    const HealthCheckResponse::ServingStatus status = Status();
    absl::MutexLock lock(&write_mu_);
    if (finished_) return;
    if (writing_) {
      pending_ = true;
      return;
    }
    if (status == last_sent_) return;
    last_sent_ = status;
    writing_ = true;
    response_ = Serialized(status);
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    bool again = false;
    {
      absl::MutexLock lock(&write_mu_);
      writing_ = false;
      if (finish_after_write_.has_value()) {
        finish = std::move(finish_after_write_);
        finish_after_write_.reset();
      } else if (ok && pending_) {
        pending_ = false;
        again = true;
      }
    }
    if (finish.has_value()) Finish(*finish);
    if (again) Notify();
  }

  void OnCancel() override { TryFinish(grpc::Status::CANCELLED); }

  void OnDone() override {
    {
      absl::MutexLock lock(&service_->mu_);
      service_->calls_.erase(this);
      if (reading_) {
        reading_ = false;
        --service_->reading_;
      }
      if (watching_) {
        watching_ = false;
        --service_->watching_;
        auto it = service_->watching_per_peer_.find(peer_);
        if (--it->second == 0) service_->watching_per_peer_.erase(it);
      }
    }
    Unref();
  }

  // Finishes the call once (after a write in flight).
  void TryFinish(const grpc::Status& status) {
    {
      absl::MutexLock lock(&write_mu_);
      if (finished_) return;
      finished_ = true;
      if (writing_) {
        finish_after_write_ = status;
        return;
      }
    }
    Finish(status);
  }

  bool watching() const { return watching_; }  // under the service's mu_

 private:
  void DoneReading() {
    absl::MutexLock lock(&service_->mu_);
    if (reading_) {
      reading_ = false;
      --service_->reading_;
    }
  }
  // Counts this Watch open, or says why it may not be.
  std::optional<grpc::Status> StartWatching() {
    absl::MutexLock lock(&service_->mu_);
    const int per_connection = service_->max_watching_per_connection_;
    const int in_all = service_->max_watching_;
    int& mine = service_->watching_per_peer_[peer_];
    if (mine >= per_connection || service_->watching_ >= in_all) {
      const bool connection = mine >= per_connection;
      if (mine == 0) service_->watching_per_peer_.erase(peer_);
      return grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          connection ? absl::StrCat("this connection has ", per_connection,
                                    " health Watch calls open: at most ", per_connection, " per connection")
                     : absl::StrCat("the server has ", in_all, " health Watch calls open: at most ", in_all,
                                    " (Check is not limited)"));
    }
    ++mine;
    ++service_->watching_;
    watching_ = true;
    return std::nullopt;
  }
  HealthCheckResponse::ServingStatus Status() const {
    if (!known_) return HealthCheckResponse::SERVICE_UNKNOWN;
    absl::MutexLock lock(&service_->mu_);
    return service_->serving_ ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
  }

  HealthService* const service_;
  const bool watch_;
  const std::string peer_;
  const absl::Time start_;
  std::atomic<int> refs_{1};  // gRPC's, until OnDone
  grpc::ByteBuffer request_, response_;
  bool known_ = false;
  // Under the service's mu_.
  bool reading_ = false;
  bool watching_ = false;
  absl::Mutex write_mu_;
  bool finished_ ABSL_GUARDED_BY(write_mu_) = false;
  bool writing_ ABSL_GUARDED_BY(write_mu_) = false;
  bool pending_ ABSL_GUARDED_BY(write_mu_) = false;
  std::optional<grpc::Status> finish_after_write_ ABSL_GUARDED_BY(write_mu_);
  HealthCheckResponse::ServingStatus last_sent_ ABSL_GUARDED_BY(write_mu_) = HealthCheckResponse::UNKNOWN;
};

HealthService::HealthService(absl::Duration read_timeout, int max_watching, int max_watching_per_connection)
    : read_timeout_(std::min(read_timeout, kReadTimeout)),
      max_watching_(max_watching),
      max_watching_per_connection_(max_watching_per_connection) {
  const char* const names[] = {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"};
  for (int i = 0; i < 2; ++i) {
    AddMethod(new grpc::internal::RpcServiceMethod(names[i], grpc::internal::RpcMethod::BIDI_STREAMING, nullptr));
    MarkMethodRawCallback(i, new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                                 [this, watch = i == 1](grpc::CallbackServerContext* context) {
                                   auto* call = new Call(this, watch, context->peer());
                                   call->Start();
                                   return call;
                                 }));
  }
  sweeper_ = std::make_unique<ReadSweeper>(ReadSweeper::TickFor(read_timeout_, absl::Milliseconds(50)),
                                           [this](absl::Time now) { return Sweep(now); });
}

HealthService::~HealthService() { sweeper_.reset(); }

bool HealthService::Sweep(absl::Time now) {
  std::vector<Call*> overdue;
  bool reading;
  {
    absl::MutexLock lock(&mu_);
    for (Call* call : calls_) {
      if (call->ReadOverdue(now, read_timeout_)) {
        call->Ref();
        overdue.push_back(call);
      }
    }
    reading = reading_ > 0;
  }
  for (Call* call : overdue) {
    call->TryFinish(grpc::Status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrCat("the HealthCheckRequest did not arrive within ", absl::FormatDuration(read_timeout_),
                     " of the call's start")));
    call->Unref();
  }
  return reading;
}

void HealthService::SetServing(bool serving) {
  std::vector<Call*> watchers;
  {
    absl::MutexLock lock(&mu_);
    serving_ = serving;
    for (Call* call : calls_) {
      if (call->watching()) {
        call->Ref();
        watchers.push_back(call);
      }
    }
  }
  for (Call* call : watchers) {
    call->Notify();
    call->Unref();
  }
}

void HealthService::Shutdown() {
  std::vector<Call*> calls;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    for (Call* call : calls_) {
      call->Ref();
      calls.push_back(call);
    }
  }
  for (Call* call : calls) {
    call->TryFinish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down"));
    call->Unref();
  }
}

int HealthService::reading() const {
  absl::MutexLock lock(&mu_);
  return reading_;
}

int HealthService::watching() const {
  absl::MutexLock lock(&mu_);
  return watching_;
}

}  // namespace attnserve
