#include "tests/client/fault_injection.h"

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace attnserve {
namespace {

using grpc::experimental::InterceptionHookPoints;

constexpr absl::string_view kService = "/attnserve.v1.AttentionService/";

// One call's fault, applied at the hook points where gRPC lets a client
// interceptor decide what the caller sees.
class FaultInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit FaultInterceptor(Fault fault) : fault_(fault) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (fault_ == Fault::kUnreachable) {
      // Hijacked: nothing is sent; the call ends with the status set here.
      if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_RECV_MESSAGE)) {
        m->FailHijackedRecvMessage();
      }
      if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_RECV_STATUS)) {
        *m->GetRecvStatus() = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                           "injected fault: the server cannot be reached");
      }
      if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
        m->Hijack();
        return;
      }
    } else if (fault_ == Fault::kReplyLost &&
               m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_STATUS)) {
      // The server answered; the caller sees its deadline pass instead.
      *m->GetRecvStatus() =
          grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "injected fault: the reply was lost");
    }
    m->Proceed();
  }

 private:
  const Fault fault_;
};

class FaultFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  FaultFactory(std::shared_ptr<FaultInjector> injector, std::string target)
      : injector_(std::move(injector)), target_(std::move(target)) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* info) override {
    return new FaultInterceptor(injector_->Decide(target_, info->method()));
  }

 private:
  std::shared_ptr<FaultInjector> injector_;
  std::string target_;
};

}  // namespace

std::function<std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>(
    const std::string& target)>
FaultInjector::Interceptors() {
  std::shared_ptr<FaultInjector> self = shared_from_this();
  return [self](const std::string& target) {
    std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> out;
    out.push_back(std::make_unique<FaultFactory>(self, target));
    return out;
  };
}

void FaultInjector::SetRates(double unreachable, double reply_lost) {
  absl::MutexLock lock(&mu_);
  unreachable_ = unreachable;
  reply_lost_ = reply_lost;
}

void FaultInjector::Exempt(const std::string& method) {
  absl::MutexLock lock(&mu_);
  exempt_.insert(method);
}

void FaultInjector::FailNext(const std::string& method, Fault fault, const std::string& target) {
  absl::MutexLock lock(&mu_);
  next_.push_back({method, target, fault});
}

void FaultInjector::SetDown(const std::string& target, bool down) {
  absl::MutexLock lock(&mu_);
  if (down) {
    down_.insert(target);
  } else {
    down_.erase(target);
  }
}

int64_t FaultInjector::injected() const {
  absl::MutexLock lock(&mu_);
  return unreachable_count_ + reply_lost_count_;
}

int64_t FaultInjector::injected(Fault f) const {
  absl::MutexLock lock(&mu_);
  return f == Fault::kUnreachable ? unreachable_count_
         : f == Fault::kReplyLost ? reply_lost_count_
                                  : 0;
}

absl::flat_hash_map<std::string, int64_t> FaultInjector::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

Fault FaultInjector::Decide(const std::string& target, const std::string& method) {
  if (!absl::StartsWith(method, kService)) return Fault::kNone;  // health checks
  const std::string name(absl::string_view(method).substr(kService.size()));
  absl::MutexLock lock(&mu_);
  ++calls_[name];
  Fault fault = Fault::kNone;
  if (down_.contains(target)) {
    fault = Fault::kUnreachable;
  } else {
    for (auto it = next_.begin(); it != next_.end(); ++it) {
      if (it->method == name && (it->target.empty() || it->target == target)) {
        fault = it->fault;
        next_.erase(it);
        break;
      }
    }
    if (fault == Fault::kNone && !exempt_.contains(name) && (unreachable_ > 0 || reply_lost_ > 0)) {
      const double u = std::uniform_real_distribution<double>(0, 1)(gen_);
      if (u < unreachable_) {
        fault = Fault::kUnreachable;
      } else if (u < unreachable_ + reply_lost_) {
        fault = Fault::kReplyLost;
      }
    }
  }
  if (fault == Fault::kUnreachable) ++unreachable_count_;
  if (fault == Fault::kReplyLost) ++reply_lost_count_;
  return fault;
}

}  // namespace attnserve
