#include "client/lease.h"

#include <algorithm>

#include "absl/time/time.h"

namespace attnserve {

absl::StatusOr<std::unique_ptr<LeaseKeeper>> LeaseKeeper::Start(Client* client, int64_t ttl_ms) {
  auto granted = client->GrantLease(ttl_ms);
  if (!granted.ok()) return granted.status();
  std::unique_ptr<LeaseKeeper> keeper(new LeaseKeeper(client, granted->id, granted->ttl_ms));
  client->UseLease(granted->id);
  keeper->thread_ = std::thread([k = keeper.get()] { k->Run(); });
  return keeper;
}

LeaseKeeper::LeaseKeeper(Client* client, uint64_t id, int64_t ttl_ms)
    : client_(client), id_(id), ttl_ms_(ttl_ms) {}

LeaseKeeper::~LeaseKeeper() {
  Stop();
  bool revoked;
  {
    absl::MutexLock lock(&mu_);
    revoked = revoked_ || !status_.ok();
  }
  if (!revoked) client_->RevokeLease(id_).IgnoreError();
  if (client_->lease_id() == id_) client_->UseLease(0);
}

void LeaseKeeper::Run() {
  // Renew every third of the ttl; after a failure, retry sooner (but never
  // more often than every 50 ms) so that a brief outage does not cost the
  // lease.
  const absl::Duration period = absl::Milliseconds(std::max<int64_t>(ttl_ms_ / 3, 50));
  absl::Duration wait = period;
  while (!stop_.WaitForNotificationWithTimeout(wait)) {
    // A renewal may take up to the whole ttl: one that takes longer could
    // not have kept the lease anyway. Stop() cancels it.
    grpc::ClientContext ctx;
    {
      absl::MutexLock lock(&mu_);
      if (stop_.HasBeenNotified()) return;
      renewal_ = &ctx;
    }
    auto renewed = client_->KeepAlive(id_, ttl_ms_ / 1000.0, &ctx);
    {
      absl::MutexLock lock(&mu_);
      renewal_ = nullptr;
    }
    if (renewed.ok()) {
      wait = period;
      continue;
    }
    // The lease is gone, or the server restarted (which ended every lease):
    // renewing would only be refused again.
    if (IsLeaseExpired(renewed.status()) || IsStaleIncarnation(renewed.status())) {
      absl::MutexLock lock(&mu_);
      status_ = renewed.status();
      return;
    }
    wait = std::max(period / 4, absl::Milliseconds(50));
  }
}

bool LeaseKeeper::expired() const {
  absl::MutexLock lock(&mu_);
  return IsLeaseExpired(status_);
}

absl::Status LeaseKeeper::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

void LeaseKeeper::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  {
    absl::MutexLock lock(&mu_);
    if (renewal_ != nullptr) renewal_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

void LeaseKeeper::Abandon() {
  Stop();
  absl::MutexLock lock(&mu_);
  revoked_ = true;  // nothing left for the destructor to revoke
}

absl::StatusOr<v1::Holdings> LeaseKeeper::Revoke() {
  Stop();
  auto released = client_->RevokeLease(id_);
  if (released.ok()) {
    absl::MutexLock lock(&mu_);
    revoked_ = true;
  }
  return released;
}

}  // namespace attnserve
