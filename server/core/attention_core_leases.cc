// AttentionCore's leases (docs/security.md, "Leases"): granting and
// renewing them, and releasing what a tenant or a lease holds (its pages
// zeroed, plans released, regions unregistered, channels closed) when a
// lease expires, is revoked, or a tenant asks for all of it. The rest of the
// core is in attention_core.cc.
#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/core/attention_core.h"
#include "server/core/status_macros.h"

namespace attnserve {

absl::Status AttentionCore::RenewLease(const CallContext& ctx) {
  if (ctx.lease_id == 0) return absl::OkStatus();
  return leases_.Renew(ctx.tenant, ctx.lease_id, absl::Now()).status();
}

HoldingsData AttentionCore::ReleaseHeld(const std::string& tenant, uint64_t lease, DoneCallback zeroed) {
  HoldingsData out;
  // Channels before the regions they poll; plans before the pages they pin.
  out.channels = channels_.CloseHeld(tenant, lease);
  out.regions = regions_.TakeHeld(tenant, lease);
  out.plans = plans_.TakeIf(tenant, [lease](const Plan& p) { return lease == 0 || p.lease == lease; });
  out.pages = pages_.FreeHeld(tenant, lease);
  if (lease != 0 && !out.pages.empty()) {
    // A plan outside the lease that names a page freed here goes too: the
    // page is gone, and a plan is never validated again.
    const absl::flat_hash_set<int32_t> freed(out.pages.begin(), out.pages.end());
    std::vector<uint64_t> more = plans_.TakeIf(tenant, [&freed](const Plan& p) {
      return std::any_of(p.layout.pages.begin(), p.layout.pages.end(),
                         [&freed](int32_t page) { return freed.contains(page); });
    });
    out.plans.insert(out.plans.end(), more.begin(), more.end());
    std::sort(out.plans.begin(), out.plans.end());
  }
  // Freed pages are zeroed before anyone can allocate them again (pinned ones
  // when their requests finish).
  if (!out.pages.empty()) {
    scheduler_->ScrubReleased(std::move(zeroed));
  } else if (zeroed) {
    zeroed(absl::OkStatus());
  }
  UpdatePageGauges();
  metrics_->SetTenantPages(tenant, pages_.TenantPages(tenant));
  UpdateRegionGauges(tenant);
  UpdateChannelGauge(tenant);
  return out;
}

void AttentionCore::CountRelease(Metrics::Release why, int64_t leases,
                                 const HoldingsData& released) {
  metrics_->ObserveRelease(why, leases, static_cast<int64_t>(released.pages.size()),
                           static_cast<int64_t>(released.plans.size()),
                           static_cast<int64_t>(released.regions.size()),
                           static_cast<int64_t>(released.channels.size()));
}

absl::StatusOr<LeaseTable::Granted> AttentionCore::GrantLease(const CallContext& ctx,
                                                              int64_t ttl_ms) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(ctx.expected_incarnation, incarnation_));
  if (ttl_ms < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ttl_ms=", ttl_ms, " is negative"));
  }
  auto granted = leases_.Grant(ctx.tenant, absl::Milliseconds(ttl_ms), absl::Now());
  if (granted.ok()) metrics_->SetTenantLeases(ctx.tenant, leases_.TenantLeases(ctx.tenant));
  return granted;
}

absl::StatusOr<int64_t> AttentionCore::KeepAlive(const CallContext& ctx, uint64_t lease_id) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(ctx.expected_incarnation, incarnation_));
  if (lease_id == 0) return absl::InvalidArgumentError("lease_id is 0: name a lease (GrantLease)");
  ATTN_ASSIGN_OR_RETURN(absl::Duration ttl, leases_.Renew(ctx.tenant, lease_id, absl::Now()));
  return absl::ToInt64Milliseconds(ttl);
}

// The answer of RevokeLease and ReleaseHoldings, once their pages are zeroed
// (ReleaseHeld's `zeroed`, which may run before ReleaseHeld returns).
struct AttentionCore::PendingRelease {
  absl::Mutex mu;
  HoldingsData released;
  bool have_released = false, zeroed = false;
  HoldingsCallback done;
  // Runs `done` once both are in.
  void Set(std::optional<HoldingsData> r, bool z) {
    HoldingsCallback fire;
    HoldingsData answer;
    {
      absl::MutexLock lock(&mu);
      if (r) {
        released = std::move(*r);
        have_released = true;
      }
      zeroed |= z;
      if (have_released && zeroed && done != nullptr) {
        fire = std::exchange(done, nullptr);
        answer = std::move(released);
      }
    }
    if (fire) fire(std::move(answer));
  }
};

void AttentionCore::RevokeLease(const CallContext& ctx, uint64_t lease_id, HoldingsCallback done) {
  if (absl::Status stale = CheckIncarnation(ctx.expected_incarnation, incarnation_); !stale.ok()) {
    done(stale);
    return;
  }
  if (lease_id == 0) {
    done(absl::InvalidArgumentError("lease_id is 0: name a lease (GrantLease)"));
    return;
  }
  auto pending = std::make_shared<PendingRelease>();
  pending->done = std::move(done);
  HoldingsData released;
  LeaseTable::Revoked how;
  {
    absl::MutexLock lock(&lease_mu_);
    how = leases_.Revoke(ctx.tenant, lease_id, absl::Now());
    // Gone already (expired and released, or revoked before): nothing to do.
    if (how == LeaseTable::Revoked::kGone) {
      pending->Set(HoldingsData(), true);
      return;
    }
    released = ReleaseHeld(ctx.tenant, lease_id, [pending](absl::Status) { pending->Set(std::nullopt, true); });
  }
  metrics_->SetTenantLeases(ctx.tenant, leases_.TenantLeases(ctx.tenant));
  // A lease past its deadline ended by expiry, whoever releases it.
  CountRelease(how == LeaseTable::Revoked::kExpired ? Metrics::Release::kExpired : Metrics::Release::kRevoked, 1,
               released);
  pending->Set(std::move(released), false);
}

absl::StatusOr<ListHoldingsData> AttentionCore::ListHoldings(const CallContext& ctx,
                                                             uint64_t lease_id) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(ctx.expected_incarnation, incarnation_));
  const absl::Time now = absl::Now();
  ListHoldingsData out;
  std::vector<LeaseTable::Info> leases = leases_.List(ctx.tenant, lease_id);
  metrics_->SetTenantLeases(ctx.tenant, leases_.TenantLeases(ctx.tenant));
  if (lease_id != 0 && leases.empty()) return LeaseTable::ExpiredError(lease_id);
  absl::flat_hash_map<uint64_t, HoldingsData*> by_lease;
  out.leases.reserve(leases.size());
  for (const LeaseTable::Info& l : leases) {
    LeaseData d;
    d.id = l.id;
    d.ttl_ms = absl::ToInt64Milliseconds(l.ttl);
    d.remaining_ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(l.deadline - now));
    out.leases.push_back(std::move(d));
  }
  for (LeaseData& d : out.leases) by_lease[d.id] = &d.holdings;
  // Entries under a lease that ended a moment ago (its release under way)
  // are not listed.
  auto holder = [&](uint64_t lease) -> HoldingsData* {
    if (lease == 0) return lease_id == 0 ? &out.unleased : nullptr;
    auto it = by_lease.find(lease);
    return it == by_lease.end() ? nullptr : it->second;
  };
  for (const PageTable::Held& h : pages_.List(ctx.tenant, lease_id)) {
    if (HoldingsData* d = holder(h.lease)) d->pages.push_back(h.page);
  }
  for (const auto& [id, lease] : plans_.List(ctx.tenant, lease_id)) {
    if (HoldingsData* d = holder(lease)) d->plans.push_back(id);
  }
  for (const RegionInfoData& r : regions_.List(ctx.tenant)) {
    if (lease_id != 0 && r.lease != lease_id) continue;
    if (HoldingsData* d = holder(r.lease)) d->regions.push_back(r.name);
  }
  for (const auto& [id, lease] : channels_.List(ctx.tenant, lease_id)) {
    if (HoldingsData* d = holder(lease)) d->channels.push_back(id);
  }
  return out;
}

void AttentionCore::ReleaseHoldings(const CallContext& ctx, HoldingsCallback done) {
  if (absl::Status stale = CheckIncarnation(ctx.expected_incarnation, incarnation_); !stale.ok()) {
    done(stale);
    return;
  }
  auto pending = std::make_shared<PendingRelease>();
  pending->done = std::move(done);
  HoldingsData released;
  int64_t leases = 0;
  {
    absl::MutexLock lock(&lease_mu_);
    leases = static_cast<int64_t>(leases_.RevokeAll(ctx.tenant).size());
    released = ReleaseHeld(ctx.tenant, 0, [pending](absl::Status) { pending->Set(std::nullopt, true); });
  }
  metrics_->SetTenantLeases(ctx.tenant, 0);
  CountRelease(Metrics::Release::kReleaseHoldings, leases, released);
  pending->Set(std::move(released), false);
}

}  // namespace attnserve
