// PlanTable: ids, tenants, the per-tenant caps (plans and bytes) and idle
// expiry.
#include "server/core/plan_table.h"

#include "absl/strings/str_cat.h"
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
  PlanTable plans(2, int64_t{1} << 30, absl::Seconds(60));
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
  PlanTable plans(8, int64_t{1} << 30, absl::Seconds(60));
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

// A plan counts what it holds (its arrays) against the tenant's bytes; a
// plan that goes (released, expired, taken) gives them back.
TEST(PlanTableTest, ATenantsPlansHoldAtMostTheirBytes) {
  int released = 0;
  auto sized = [&](const std::string& tenant, size_t indices) {
    std::shared_ptr<Plan> plan = PlanOf(tenant, &released);
    plan->kv_indices.resize(indices);
    plan->layout.pages.resize(indices);
    plan->unsettled.resize(indices);
    return plan;
  };
  const int64_t one = PlanBytes(*sized("x", 100000));
  EXPECT_GE(one, 100000 * (4 + 4 + 8));
  EXPECT_LT(one, 100000 * (4 + 4 + 8) + 4096);
  PlanTable plans(64, 2 * one + one / 2, absl::Seconds(60));
  auto a1 = plans.Add(sized("a", 100000));
  auto a2 = plans.Add(sized("a", 100000));
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_EQ(plans.TenantBytes("a"), 2 * one);
  auto refused = plans.Add(sized("a", 100000));
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status()));
  EXPECT_EQ(std::string(refused.status().message()),
            absl::StrCat("the plan takes ", one, " bytes of server memory and the tenant's 2 plans "
                         "hold ", 2 * one, ", at most ", 2 * one + one / 2,
                         " in all (--max_plan_bytes_per_tenant): release plans no longer used "
                         "(ReleasePlan)"));
  EXPECT_TRUE(plans.Add(sized("a", 1000)).ok()) << "a small one still fits";
  EXPECT_TRUE(plans.Add(sized("b", 100000)).ok()) << "the bytes are per tenant";
  ASSERT_TRUE(plans.Remove("a", *a1).ok());
  EXPECT_TRUE(plans.Add(sized("a", 100000)).ok()) << "a released plan gives its bytes back";
  EXPECT_EQ(plans.TakeExpired(absl::Now() + absl::Seconds(61)), 4);
  EXPECT_EQ(plans.TenantBytes("a"), 0);
  EXPECT_EQ(plans.TenantBytes("b"), 0);
  auto taken = plans.Add(sized("a", 100000));
  ASSERT_TRUE(taken.ok());
  EXPECT_EQ(plans.TakeIf("a", [](const Plan&) { return true; }).size(), 1u);
  EXPECT_EQ(plans.TenantBytes("a"), 0);
}

}  // namespace
}  // namespace attnserve
