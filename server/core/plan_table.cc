#include "server/core/plan_table.h"

#include <algorithm>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace attnserve {

absl::Status CheckPlanLease(const Plan& plan, uint64_t lease) {
  if (lease == 0 || plan.lease == lease) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "plan_id=%d is not held under lease %#x: a client may use only the plans of its own lease",
      plan.id, lease));
}

int64_t PlanBytes(const Plan& plan) {
  auto bytes = [](const auto& v) {
    return static_cast<int64_t>(v.capacity() * sizeof(typename std::decay_t<decltype(v)>::value_type));
  };
  int64_t n = static_cast<int64_t>(sizeof(Plan)) + bytes(plan.kv_indices) + bytes(plan.append_slots) +
              bytes(plan.layout.seqs) + bytes(plan.layout.pages) + bytes(plan.unsettled) +
              bytes(plan.options.all.sinks);
  for (const auto& [layer, options] : plan.options.layers) {
    n += static_cast<int64_t>(sizeof(layer) + sizeof(options)) + bytes(options.sinks);
  }
  return n;
}

absl::StatusOr<uint64_t> PlanTable::Add(std::shared_ptr<Plan> plan) {
  const int64_t bytes = PlanBytes(*plan);
  absl::MutexLock lock(&mu_);
  Held& held = per_tenant_[plan->tenant];
  if (held.plans >= max_per_tenant_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the tenant holds ", held.plans, " plans, at most ", max_per_tenant_,
        " (--max_plans_per_tenant): release plans no longer used (ReleasePlan)"));
  }
  if (bytes > max_bytes_per_tenant_ - held.bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the plan takes ", bytes, " bytes of server memory and the tenant's ", held.plans,
        " plans hold ", held.bytes, ", at most ", max_bytes_per_tenant_,
        " in all (--max_plan_bytes_per_tenant): release plans no longer used (ReleasePlan)"));
  }
  uint64_t id = 0;
  while (id == 0 || plans_.contains(id)) id = absl::Uniform<uint64_t>(gen_);
  plan->id = id;
  ++held.plans;
  held.bytes += bytes;
  plans_[id] = Entry{std::move(plan), bytes, absl::Now()};
  return id;
}

std::shared_ptr<const Plan> PlanTable::Take(absl::flat_hash_map<uint64_t, Entry>::iterator it) {
  Held& held = per_tenant_[it->second.plan->tenant];
  --held.plans;
  held.bytes -= it->second.bytes;
  std::shared_ptr<const Plan> plan = std::move(it->second.plan);
  plans_.erase(it);
  return plan;
}

int64_t PlanTable::TenantBytes(absl::string_view tenant) {
  absl::MutexLock lock(&mu_);
  auto it = per_tenant_.find(tenant);
  return it == per_tenant_.end() ? 0 : it->second.bytes;
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
    removed = Take(plans_.find(id));
  }
  return absl::OkStatus();
}

int PlanTable::TakeExpired(absl::Time now) {
  std::vector<std::shared_ptr<const Plan>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = plans_.begin(); it != plans_.end();) {
      if (now - it->second.last_used >= idle_timeout_) {
        expired.push_back(Take(it++));
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
        ids.push_back(it->first);
        taken.push_back(Take(it++));
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
