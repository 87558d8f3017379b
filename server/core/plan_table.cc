#include "server/core/plan_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attnserve {

absl::StatusOr<uint64_t> PlanTable::Add(std::shared_ptr<Plan> plan) {
  absl::MutexLock lock(&mu_);
  int32_t& count = per_tenant_[plan->tenant];
  if (count >= max_per_tenant_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the tenant holds ", count, " plans, at most ", max_per_tenant_,
        " (--max_plans_per_tenant): release plans no longer used (ReleasePlan)"));
  }
  uint64_t id = 0;
  while (id == 0 || plans_.contains(id)) id = absl::Uniform<uint64_t>(gen_);
  plan->id = id;
  ++count;
  plans_[id] = Entry{std::move(plan), absl::Now()};
  return id;
}

absl::StatusOr<PlanTable::Entry*> PlanTable::Lookup(absl::string_view tenant, uint64_t id) {
  auto it = plans_.find(id);
  if (it == plans_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "plan_id=", id, " is unknown: never made, released, unused for ",
        absl::FormatDuration(idle_timeout_),
        " (--plan_idle_timeout_s), or made before the server restarted"));
  }
  if (it->second.plan->tenant != tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat("plan_id=", id, " belongs to another tenant"));
  }
  return &it->second;
}

absl::StatusOr<std::shared_ptr<const Plan>> PlanTable::Find(absl::string_view tenant,
                                                            uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto entry = Lookup(tenant, id);
  if (!entry.ok()) return entry.status();
  (*entry)->last_used = absl::Now();
  return (*entry)->plan;
}

absl::Status PlanTable::Remove(absl::string_view tenant, uint64_t id) {
  std::shared_ptr<const Plan> removed;  // dropped after the lock: it may unpin
  {
    absl::MutexLock lock(&mu_);
    auto entry = Lookup(tenant, id);
    if (!entry.ok()) return entry.status();
    removed = std::move((*entry)->plan);
    --per_tenant_[removed->tenant];
    plans_.erase(id);
  }
  return absl::OkStatus();
}

int PlanTable::TakeExpired(absl::Time now) {
  std::vector<std::shared_ptr<const Plan>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = plans_.begin(); it != plans_.end();) {
      if (now - it->second.last_used >= idle_timeout_) {
        --per_tenant_[it->second.plan->tenant];
        expired.push_back(std::move(it->second.plan));
        plans_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  return static_cast<int>(expired.size());  // unpinned as they go out of scope
}

std::vector<uint64_t> PlanTable::TakeIf(absl::string_view tenant,
                                        const std::function<bool(const Plan&)>& take) {
  std::vector<std::shared_ptr<const Plan>> taken;  // dropped after the lock: they may unpin
  std::vector<uint64_t> ids;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = plans_.begin(); it != plans_.end();) {
      const Plan& plan = *it->second.plan;
      if (plan.tenant == tenant && take(plan)) {
        --per_tenant_[plan.tenant];
        ids.push_back(it->first);
        taken.push_back(std::move(it->second.plan));
        plans_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<std::pair<uint64_t, uint64_t>> PlanTable::List(absl::string_view tenant,
                                                           uint64_t lease) {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const auto& [id, entry] : plans_) {
    if (entry.plan->tenant == tenant && (lease == 0 || entry.plan->lease == lease)) {
      out.emplace_back(id, entry.plan->lease);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace attnserve
