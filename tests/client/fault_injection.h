// FaultInjector: makes a client's calls fail the ways a network and a busy
// server do, for the fault-injection tests of KvManager and Cluster.
//
// It is a gRPC client interceptor (ClientOptions::interceptors) deciding per
// call, for the AttentionService's methods:
//   - kUnreachable: the call never leaves the client and fails UNAVAILABLE,
//     as when the server cannot be reached;
//   - kReplyLost: the call reaches the server and completes there, but the
//     client sees DEADLINE_EXCEEDED, as when the reply comes too late. This
//     is the dangerous one: the server did the work (freed the pages,
//     allocated them, made the plan) and the client does not know.
//
//   auto faults = std::make_shared<FaultInjector>(/*seed=*/7);
//   ClientOptions options;
//   options.interceptors = faults->Interceptors();
//   faults->SetRates(/*unreachable=*/0.1, /*reply_lost=*/0.1);
//   faults->FailNext("FreePages", Fault::kReplyLost);   // or deterministically
//
// Thread-safe: a cluster's Run() calls several servers at once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/client_interceptor.h"

namespace attnserve {

enum class Fault { kNone, kUnreachable, kReplyLost };

class FaultInjector : public std::enable_shared_from_this<FaultInjector> {
 public:
  explicit FaultInjector(uint64_t seed) : gen_(seed) {}

  // For ClientOptions::interceptors (and ClusterOptions::client).
  std::function<std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>(
      const std::string& target)>
  Interceptors();

  // Random faults: each call of a method not exempt fails with these
  // probabilities (0 and 0: none).
  void SetRates(double unreachable, double reply_lost);
  // Methods ("KeepAlive") never failed at random.
  void Exempt(const std::string& method);
  // The next call of `method` ("FreePages") fails with `fault`, whatever
  // the rates (to `target` only, when given).
  void FailNext(const std::string& method, Fault fault, const std::string& target = "");
  // Every call to `target` fails kUnreachable while down.
  void SetDown(const std::string& target, bool down);

  int64_t injected() const;         // faults injected so far
  int64_t injected(Fault f) const;  // of one kind
  // Calls seen per method name ("FreePages"), injected or not.
  absl::flat_hash_map<std::string, int64_t> calls() const;

  // Decides the fate of one call of `method` ("/attnserve.v1.AttentionService/FreePages")
  // to `target` (the interceptor's, public for its use).
  Fault Decide(const std::string& target, const std::string& method);

 private:
  mutable absl::Mutex mu_;
  std::mt19937_64 gen_ ABSL_GUARDED_BY(mu_);
  double unreachable_ ABSL_GUARDED_BY(mu_) = 0;
  double reply_lost_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<std::string> exempt_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> down_ ABSL_GUARDED_BY(mu_);
  struct Next {
    std::string method, target;
    Fault fault;
  };
  std::vector<Next> next_ ABSL_GUARDED_BY(mu_);
  int64_t unreachable_count_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reply_lost_count_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, int64_t> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
