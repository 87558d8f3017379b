// LeaseTable: the leases tenants hold, and when each expires
// (docs/security.md, "Leases").
//
// A lease is a time-to-live that the client renews (KeepAlive, or any
// request naming it). Pages, plans, regions and channels can be held under
// one; when it expires or is revoked, the core releases everything under it
// (AttentionCore::EndLease). This table only keeps the leases and their
// deadlines: the other tables record which lease holds each of their
// entries. The server is the authority on what expired: a lease that is
// gone is never renewed again, and a request naming it fails with
// ExpiredError.
//
//   LeaseTable leases(LeaseLimits{});
//   auto grant = leases.Grant("default", absl::ZeroDuration(), absl::Now());
//   leases.Renew("default", grant->id, absl::Now());   // lives ttl from now
//   for (auto& e : leases.TakeExpired(absl::Now())) { /* release e's holdings */ }
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

struct LeaseLimits {
  absl::Duration default_ttl = absl::Seconds(30);  // --lease_default_ttl_s
  absl::Duration max_ttl = absl::Hours(1);         // --lease_max_ttl_s
  absl::Duration min_ttl = absl::Seconds(1);
  int32_t max_per_tenant = 1024;                   // --max_leases_per_tenant
};

class LeaseTable {
 public:
  explicit LeaseTable(LeaseLimits limits) : limits_(limits) {}

  struct Granted {
    uint64_t id = 0;
    absl::Duration ttl;
  };
  // A new lease of `tenant` that expires `ttl` (zero: the default) after
  // `now` unless renewed. INVALID_ARGUMENT for a ttl out of [min, max]
  // (naming `ttl_ms`), RESOURCE_EXHAUSTED past max_per_tenant.
  absl::StatusOr<Granted> Grant(absl::string_view tenant, absl::Duration ttl, absl::Time now);

  // The lease lives its ttl from `now` again; returns the ttl.
  // ExpiredError when it is gone (expired, revoked, never granted, or
  // another tenant's).
  absl::StatusOr<absl::Duration> Renew(absl::string_view tenant, uint64_t id, absl::Time now);

  // Ends the lease now: kGone when it was gone already (or another
  // tenant's), kExpired when its deadline had passed at `now` (the reaper
  // had not taken it out yet: it ended by expiry, not by this call).
  enum class Revoked { kGone, kRevoked, kExpired };
  Revoked Revoke(absl::string_view tenant, uint64_t id, absl::Time now);
  // Ends every lease of the tenant; returns their ids, ascending.
  std::vector<uint64_t> RevokeAll(absl::string_view tenant);

  struct Ended {
    std::string tenant;
    uint64_t id = 0;
  };
  // Takes out every lease whose deadline passed at `now`.
  std::vector<Ended> TakeExpired(absl::Time now);

  struct Info {
    uint64_t id = 0;
    absl::Duration ttl;
    absl::Time deadline;
  };
  // The tenant's leases, ascending by id (id 0: all; else that one, if alive).
  std::vector<Info> List(absl::string_view tenant, uint64_t id = 0) const;

  int32_t TenantLeases(absl::string_view tenant) const;
  int32_t size() const;
  const LeaseLimits& limits() const { return limits_; }

  // What a request naming a lease that is gone gets: FAILED_PRECONDITION,
  // its message starting with "lease " (the clients' typed LeaseExpired).
  static absl::Status ExpiredError(uint64_t id);

 private:
  struct Entry {
    std::string tenant;
    absl::Duration ttl;
    absl::Time deadline;
  };
  void Erase(absl::flat_hash_map<uint64_t, Entry>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LeaseLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> leases_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int32_t> per_tenant_ ABSL_GUARDED_BY(mu_);
  absl::BitGen gen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
