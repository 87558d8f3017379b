// grpc.health.v1.Health (Check and Watch) on the server's port, in place of
// gRPC's default health service. Probes call it without a token, so what an
// unauthenticated caller can make the server hold is bounded here:
// gRPC buffers a call's whole request before the service sees it (up to the
// server's message limit, which the attention service needs large), so a
// health call's request must arrive within kReadTimeout of the call's start
// (a HealthCheckRequest is a service name: it comes with the headers), at
// most kMaxReading calls wait for theirs at once (more: RESOURCE_EXHAUSTED,
// their bodies never read), and a request over kMaxRequestBytes is refused.
// What a caller with no token holds is then what it can send within
// kReadTimeout on kMaxReading streams (docs/security.md). A Watch that has
// its request stays open until its caller ends it: at most
// kMaxWatchingPerConnection of them per connection and kMaxWatching in all
// (more: RESOURCE_EXHAUSTED, naming the cap; Check is not counted), about
// 8 KiB each.
//
// Statuses: "" (the server) and attnserve.v1.AttentionService, SERVING from
// the start until SetServing(false) (a drain); other names are NOT_FOUND
// (Check) or SERVICE_UNKNOWN (Watch), as the health protocol says. Watch
// sends the status at once and again when it changes, until the caller
// cancels or Shutdown ends it.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/impl/service_type.h"
#include "grpcpp/support/server_callback.h"
#include "server/grpc/read_sweeper.h"

namespace attnserve {

class HealthService : public grpc::Service {
 public:
  static constexpr absl::Duration kReadTimeout = absl::Milliseconds(250);
  static constexpr int kMaxReading = 64;
  static constexpr int64_t kMaxRequestBytes = 1024;
  static constexpr int kMaxWatching = 4096;
  static constexpr int kMaxWatchingPerConnection = 64;

  // read_timeout: the server's --request_read_timeout_s (the shorter of it
  // and kReadTimeout applies). max_watching, max_watching_per_connection:
  // the Watch caps (tests lower them).
  explicit HealthService(absl::Duration read_timeout, int max_watching = kMaxWatching,
                         int max_watching_per_connection = kMaxWatchingPerConnection);
  ~HealthService() override;

  // Both statuses at once (the drain turns them NOT_SERVING).
  void SetServing(bool serving);
  // Ends every Watch (before the server shuts down).
  void Shutdown();

  // Calls waiting for their request now, Watch calls open now (tests).
  int reading() const;
  int watching() const;

 private:
  class Call;
  // The read timeouts: finishes the overdue calls; whether any call still
  // waits for its request.
  bool Sweep(absl::Time now);

  const absl::Duration read_timeout_;
  const int max_watching_;
  const int max_watching_per_connection_;
  mutable absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = true;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<Call*> calls_ ABSL_GUARDED_BY(mu_);
  int reading_ ABSL_GUARDED_BY(mu_) = 0;
  int watching_ ABSL_GUARDED_BY(mu_) = 0;
  // Open Watch calls per connection (ServerContext::peer()).
  absl::flat_hash_map<std::string, int> watching_per_peer_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ReadSweeper> sweeper_;  // stopped first (the destructor)
};

}  // namespace attnserve
