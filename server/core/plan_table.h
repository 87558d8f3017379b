// PlanTable: the step layouts clients registered with CreatePlan.
//
// A page id names the same slots in every layer, so one decode step's layout
// (indptrs, page ids, last-page lengths, append slots) is the same for all
// of a model's layers; the plan may also hold each layer's attention options
// (docs/design.md, "Variants"). A client registers it once; every layer's Prefill then
// names the plan instead of sending the layout again, and the server
// neither re-validates nor re-pins it. A plan's pages stay pinned (and
// cannot be freed) until the plan is released, expires, or the server stops.
//
//   PlanTable plans(/*max_per_tenant=*/64, /*max_bytes_per_tenant=*/1 << 30,
//                   absl::Seconds(300));
//   auto id = plans.Add(std::move(plan));          // RESOURCE_EXHAUSTED past a cap
//   auto found = plans.Find("default", *id);       // shared: in-flight jobs keep it alive
//   plans.Remove("default", *id);
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/core/validate.h"
#include "server/core/written_rows.h"

namespace attnserve {

struct Plan {
  uint64_t id = 0;
  std::string tenant;
  uint64_t lease = 0;                 // held under this lease (0: none)
  std::vector<int32_t> kv_indices;    // the tasks point into these two
  std::vector<int64_t> append_slots;
  ValidatedLayout layout;             // layout.pages are pinned for the plan
  PlanOptions options;                // per layer; tasks point at their sinks
  // With --check_kv_written: the pages its requests' check looks at
  // (WrittenRows::Unsettled, taken once its pages were pinned).
  std::vector<WrittenRows::Position> unsettled;
};

// The memory a plan holds while it lives (its arrays and itself), counted
// against the tenant's --max_plan_bytes_per_tenant.
int64_t PlanBytes(const Plan& plan);

// A request naming a lease (non-zero) may use only a plan made under it:
// FAILED_PRECONDITION otherwise.
absl::Status CheckPlanLease(const Plan& plan, uint64_t lease);

class PlanTable {
 public:
  PlanTable(int32_t max_per_tenant, int64_t max_bytes_per_tenant, absl::Duration idle_timeout)
      : max_per_tenant_(max_per_tenant),
        max_bytes_per_tenant_(max_bytes_per_tenant),
        idle_timeout_(idle_timeout) {}

  // Registers `plan` under a new random non-zero id (set in the plan) and
  // returns it. RESOURCE_EXHAUSTED when the tenant already holds
  // max_per_tenant plans, or its plans and this one would hold more than
  // max_bytes_per_tenant bytes (PlanBytes).
  absl::StatusOr<uint64_t> Add(std::shared_ptr<Plan> plan);
  // The tenant's plan, marked used now. NOT_FOUND for an id it does not
  // know (never made, released, expired, or made before a restart),
  // PERMISSION_DENIED for another tenant's.
  absl::StatusOr<std::shared_ptr<const Plan>> Find(absl::string_view tenant, uint64_t id);
  // Takes the tenant's plan out of the table (errors as Find). Its pages stay
  // pinned until the last request using it has finished.
  absl::Status Remove(absl::string_view tenant, uint64_t id);
  // Takes out every plan unused for the idle timeout; returns how many.
  int TakeExpired(absl::Time now);
  // Takes out the tenant's plans for which `take` is true and returns their
  // ids. Their pages stay pinned until the last request using one finishes.
  std::vector<uint64_t> TakeIf(absl::string_view tenant,
                               const std::function<bool(const Plan&)>& take);
  // The tenant's plans (lease 0: all; else that lease's), with their leases.
  std::vector<std::pair<uint64_t, uint64_t>> List(absl::string_view tenant,
                                                  uint64_t lease = 0);

  int32_t max_per_tenant() const { return max_per_tenant_; }
  // The bytes the tenant's plans hold (PlanBytes of each).
  int64_t TenantBytes(absl::string_view tenant);
  absl::Duration idle_timeout() const { return idle_timeout_; }

 private:
  struct Entry {
    std::shared_ptr<const Plan> plan;
    int64_t bytes = 0;  // PlanBytes at Add
    absl::Time last_used;
  };
  // What a tenant's plans hold.
  struct Held {
    int32_t plans = 0;
    int64_t bytes = 0;
  };
  absl::StatusOr<Entry*> Lookup(absl::string_view tenant, uint64_t id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the entry's plan out of the table and the tenant's count.
  std::shared_ptr<const Plan> Take(absl::flat_hash_map<uint64_t, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int32_t max_per_tenant_;
  const int64_t max_bytes_per_tenant_;
  const absl::Duration idle_timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> plans_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Held> per_tenant_ ABSL_GUARDED_BY(mu_);
  absl::BitGen gen_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
