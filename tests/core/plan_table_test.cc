// PlanTable: ids, tenants, the per-tenant cap and idle expiry.
#include "server/core/plan_table.h"

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

std::shared_ptr<Plan> PlanOf(const std::string& tenant, int* released) {
  auto* plan = new Plan();
  plan->tenant = tenant;
  return std::shared_ptr<Plan>(plan, [released](Plan* p) {
    ++*released;
    delete p;
  });
}

TEST(PlanTableTest, PlansBelongToTheirTenantAndAreCappedPerTenant) {
  int released = 0;  // outlives the table, whose plans count into it
  PlanTable plans(2, absl::Seconds(60));
  auto a1 = plans.Add(PlanOf("a", &released));
  auto a2 = plans.Add(PlanOf("a", &released));
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_NE(*a1, 0u);
  EXPECT_NE(*a1, *a2);
  EXPECT_TRUE(absl::IsResourceExhausted(plans.Add(PlanOf("a", &released)).status()));
  EXPECT_EQ(released, 1) << "a refused plan is dropped at once";
  EXPECT_TRUE(plans.Add(PlanOf("b", &released)).ok()) << "the cap is per tenant";
  auto found = plans.Find("a", *a1);
  ASSERT_TRUE(found.ok());
  EXPECT_EQ((*found)->id, *a1);
  EXPECT_TRUE(absl::IsPermissionDenied(plans.Find("b", *a1).status()));
  EXPECT_TRUE(absl::IsPermissionDenied(plans.Remove("b", *a1)));
  EXPECT_TRUE(absl::IsNotFound(plans.Find("a", *a1 ^ 1).status()));
  ASSERT_TRUE(plans.Remove("a", *a1).ok());
  EXPECT_EQ(released, 1) << "a request still holding the plan keeps it alive";
  found = absl::NotFoundError("");
  EXPECT_EQ(released, 2);
  EXPECT_TRUE(absl::IsNotFound(plans.Find("a", *a1).status()));
  EXPECT_TRUE(plans.Add(PlanOf("a", &released)).ok()) << "a released plan frees its place";
}

TEST(PlanTableTest, PlansUnusedForTheIdleTimeoutExpire) {
  int released = 0;
  PlanTable plans(8, absl::Seconds(60));
  auto used = plans.Add(PlanOf("a", &released));
  auto idle = plans.Add(PlanOf("a", &released));
  ASSERT_TRUE(used.ok() && idle.ok());
  EXPECT_EQ(plans.TakeExpired(absl::Now() + absl::Seconds(30)), 0);
  ASSERT_TRUE(plans.Find("a", *used).ok());  // used now: its clock restarts
  EXPECT_EQ(plans.TakeExpired(absl::Now() + absl::Seconds(59)), 0);
  EXPECT_EQ(released, 0);
  // 60 s after creation, `idle` was never used; `used` was used a moment ago.
  const absl::Time later = absl::Now() + absl::Seconds(60);
  EXPECT_GE(plans.TakeExpired(later), 1);
  EXPECT_TRUE(absl::IsNotFound(plans.Find("a", *idle).status()));
  EXPECT_GE(released, 1);
}

}  // namespace
}  // namespace attnserve
