// LeaseKeeper: a lease held on one server and kept alive from a background
// thread (docs/security.md, "Leases"), the pattern of etcd's lease
// keep-alive. Everything the client makes while the keeper lives is held
// under the lease (Client::UseLease): if the process dies, the server
// releases it all within the lease's ttl.
//
//   auto client = Client::Connect(options);
//   auto lease = LeaseKeeper::Start(client->get());   // the server's default ttl
//   auto pages = (*client)->AllocatePages(4);          // held under the lease
//   ...
//   lease->reset();                                    // revokes: the pages go
//
// The server is the authority on what expired. The keeper renews every
// third of the ttl; a renewal the server refuses because the lease is gone
// ends the keeper (expired() turns true, status() says why), as does one
// answered by a restarted server (status() is the stale incarnation), and every
// request that names the lease fails with IsLeaseExpired(). Failed renewals
// for other reasons (the server unreachable) are retried until the lease
// would have expired, and after that too: only the server can say.
#pragma once

#include <cstdint>
#include <memory>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"

namespace attnserve {

class LeaseKeeper {
 public:
  // Grants a lease of `ttl_ms` (0: the server's default) on `client`, makes
  // it the client's lease and starts renewing it. `client` must outlive the
  // keeper.
  static absl::StatusOr<std::unique_ptr<LeaseKeeper>> Start(Client* client, int64_t ttl_ms = 0);

  // Stops renewing, revokes the lease (best effort: an unreachable server
  // lets it expire) and clears the client's lease.
  ~LeaseKeeper();

  uint64_t id() const { return id_; }
  int64_t ttl_ms() const { return ttl_ms_; }
  // True once a renewal was refused because the lease is gone.
  bool expired() const;
  // OK, or the error of the renewal that stopped the keeper: the lease gone
  // (expired() true), or the server restarted (a stale incarnation; the
  // restart, not the lease, is what to act on: expired() stays false).
  absl::Status status() const;
  // Revokes now and returns what was released; the keeper then only waits
  // to be destroyed.
  absl::StatusOr<v1::Holdings> Revoke();
  // Stops renewing without an RPC: the server releases the lease's holdings
  // within its ttl (for a server that restarted or cannot be reached, where
  // a revocation would fail or wait). The keeper then only waits to be
  // destroyed, which revokes nothing.
  void Abandon();

 private:
  LeaseKeeper(Client* client, uint64_t id, int64_t ttl_ms);
  void Run();
  // Stops renewing: a renewal in flight is cancelled (it could wait up to
  // the ttl on an unreachable server), and the thread joined.
  void Stop();

  Client* const client_;
  const uint64_t id_;
  const int64_t ttl_ms_;
  absl::Notification stop_;
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  bool revoked_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* renewal_ ABSL_GUARDED_BY(mu_) = nullptr;  // the KeepAlive in flight
  std::thread thread_;
};

}  // namespace attnserve
