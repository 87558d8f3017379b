#include "server/core/lease_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attnserve {

absl::Status LeaseTable::ExpiredError(uint64_t id) {
  return absl::FailedPreconditionError(absl::StrFormat(
      "lease %#x has expired or was revoked (it was not renewed within its ttl, or the "
      "server restarted): everything held under it was released; start a new lease and "
      "re-create the state",
      id));
}

absl::StatusOr<LeaseTable::Granted> LeaseTable::Grant(absl::string_view tenant,
                                                      absl::Duration ttl, absl::Time now) {
  if (ttl == absl::ZeroDuration()) ttl = limits_.default_ttl;
  if (ttl < limits_.min_ttl || ttl > limits_.max_ttl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ttl_ms=", absl::ToInt64Milliseconds(ttl), " out of range [",
        absl::ToInt64Milliseconds(limits_.min_ttl), ", ",
        absl::ToInt64Milliseconds(limits_.max_ttl), "] (--lease_max_ttl_s), or 0 for the default ",
        absl::ToInt64Milliseconds(limits_.default_ttl)));
  }
  absl::MutexLock lock(&mu_);
  int32_t& count = per_tenant_[std::string(tenant)];
  if (count >= limits_.max_per_tenant) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the tenant holds ", count, " leases, at most ", limits_.max_per_tenant,
        " (--max_leases_per_tenant): revoke leases no longer used (RevokeLease)"));
  }
  uint64_t id = 0;
  while (id == 0 || leases_.contains(id)) id = absl::Uniform<uint64_t>(gen_);
  leases_[id] = Entry{std::string(tenant), ttl, now + ttl};
  ++count;
  return Granted{id, ttl};
}

absl::StatusOr<absl::Duration> LeaseTable::Renew(absl::string_view tenant, uint64_t id,
                                                 absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  // A lease past its deadline is gone even before the reaper takes it out.
  if (it == leases_.end() || it->second.tenant != tenant || now > it->second.deadline) {
    return ExpiredError(id);
  }
  it->second.deadline = now + it->second.ttl;
  return it->second.ttl;
}

void LeaseTable::Erase(absl::flat_hash_map<uint64_t, Entry>::iterator it) {
  --per_tenant_[it->second.tenant];
  leases_.erase(it);
}

LeaseTable::Revoked LeaseTable::Revoke(absl::string_view tenant, uint64_t id, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end() || it->second.tenant != tenant) return Revoked::kGone;
  const bool expired = now > it->second.deadline;
  Erase(it);
  return expired ? Revoked::kExpired : Revoked::kRevoked;
}

std::vector<uint64_t> LeaseTable::RevokeAll(absl::string_view tenant) {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> ids;
  for (auto it = leases_.begin(); it != leases_.end();) {
    auto next = std::next(it);
    if (it->second.tenant == tenant) {
      ids.push_back(it->first);
      Erase(it);
    }
    it = next;
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<LeaseTable::Ended> LeaseTable::TakeExpired(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<Ended> ended;
  for (auto it = leases_.begin(); it != leases_.end();) {
    auto next = std::next(it);
    if (now > it->second.deadline) {
      ended.push_back({it->second.tenant, it->first});
      Erase(it);
    }
    it = next;
  }
  return ended;
}

std::vector<LeaseTable::Info> LeaseTable::List(absl::string_view tenant, uint64_t id) const {
  absl::MutexLock lock(&mu_);
  std::vector<Info> out;
  for (const auto& [lease, e] : leases_) {
    if (e.tenant == tenant && (id == 0 || lease == id)) out.push_back({lease, e.ttl, e.deadline});
  }
  std::sort(out.begin(), out.end(), [](const Info& a, const Info& b) { return a.id < b.id; });
  return out;
}

int32_t LeaseTable::TenantLeases(absl::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = per_tenant_.find(tenant);
  return it == per_tenant_.end() ? 0 : it->second;
}

int32_t LeaseTable::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(leases_.size());
}

}  // namespace attnserve
