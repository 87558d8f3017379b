// LeaseTable: grants, renewals, expiry and revocation, per tenant.
#include "server/core/lease_table.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

const absl::Time kT0 = absl::FromUnixSeconds(1000);

TEST(LeaseTableTest, ALeaseLivesItsTtlFromItsLastRenewal) {
  LeaseTable leases(LeaseLimits{});
  auto g = leases.Grant("alice", absl::Seconds(10), kT0);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_NE(g->id, 0u);
  EXPECT_EQ(g->ttl, absl::Seconds(10));
  EXPECT_TRUE(leases.TakeExpired(kT0 + absl::Seconds(10)).empty()) << "expired at its deadline";
  auto renewed = leases.Renew("alice", g->id, kT0 + absl::Seconds(9));
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_EQ(*renewed, absl::Seconds(10));
  EXPECT_TRUE(leases.TakeExpired(kT0 + absl::Seconds(15)).empty()) << "renewal ignored";
  auto ended = leases.TakeExpired(kT0 + absl::Seconds(19) + absl::Milliseconds(1));
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended[0].tenant, "alice");
  EXPECT_EQ(ended[0].id, g->id);
  EXPECT_TRUE(leases.TakeExpired(kT0 + absl::Seconds(60)).empty()) << "taken twice";
  EXPECT_EQ(leases.TenantLeases("alice"), 0);
}

TEST(LeaseTableTest, AGoneLeaseIsNeverRenewedAgain) {
  LeaseTable leases(LeaseLimits{});
  auto g = leases.Grant("alice", absl::Seconds(2), kT0);
  ASSERT_TRUE(g.ok());
  // Past its deadline it is gone even before the reaper takes it out.
  absl::Status late = leases.Renew("alice", g->id, kT0 + absl::Seconds(3)).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(late.message()), StartsWith("lease "));
  EXPECT_THAT(std::string(late.message()), HasSubstr("expired"));
  ASSERT_EQ(leases.TakeExpired(kT0 + absl::Seconds(3)).size(), 1u);
  EXPECT_FALSE(leases.Renew("alice", g->id, kT0 + absl::Seconds(3)).ok());
  // Unknown ids, and another tenant's, look the same.
  auto b = leases.Grant("bob", absl::Seconds(5), kT0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(leases.Renew("alice", b->id, kT0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(leases.Renew("alice", 12345, kT0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(leases.Renew("bob", b->id, kT0).ok());
}

TEST(LeaseTableTest, RevokeEndsOnlyTheTenantsOwnLeases) {
  LeaseTable leases(LeaseLimits{});
  auto a1 = leases.Grant("alice", absl::ZeroDuration(), kT0);
  auto a2 = leases.Grant("alice", absl::ZeroDuration(), kT0);
  auto b1 = leases.Grant("bob", absl::ZeroDuration(), kT0);
  ASSERT_TRUE(a1.ok() && a2.ok() && b1.ok());
  EXPECT_EQ(a1->ttl, LeaseLimits{}.default_ttl);
  using Revoked = LeaseTable::Revoked;
  EXPECT_EQ(leases.Revoke("alice", b1->id, kT0), Revoked::kGone) << "revoked another tenant's lease";
  EXPECT_EQ(leases.Revoke("alice", a1->id, kT0), Revoked::kRevoked);
  EXPECT_EQ(leases.Revoke("alice", a1->id, kT0), Revoked::kGone) << "revoked twice";
  EXPECT_EQ(leases.List("alice").size(), 1u);
  std::vector<uint64_t> all = leases.RevokeAll("alice");
  EXPECT_EQ(all, std::vector<uint64_t>{a2->id});
  EXPECT_EQ(leases.TenantLeases("alice"), 0);
  EXPECT_EQ(leases.TenantLeases("bob"), 1);
  EXPECT_TRUE(leases.Renew("bob", b1->id, kT0).ok());
}

// A lease revoked after its deadline, before the reaper took it out, ended
// by expiry: the metrics count it so (RevokeLease's release reason).
TEST(LeaseTableTest, RevokeOfALeasePastItsDeadlineSaysExpired) {
  LeaseTable leases(LeaseLimits{});
  auto a = leases.Grant("alice", absl::Seconds(2), kT0);
  auto b = leases.Grant("alice", absl::Seconds(2), kT0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(leases.Revoke("alice", a->id, kT0 + absl::Seconds(2)), LeaseTable::Revoked::kRevoked)
      << "at its deadline a lease still lives (Renew takes it too)";
  EXPECT_EQ(leases.Revoke("alice", b->id, kT0 + absl::Seconds(3)), LeaseTable::Revoked::kExpired);
  EXPECT_EQ(leases.TenantLeases("alice"), 0);
  EXPECT_TRUE(leases.TakeExpired(kT0 + absl::Seconds(3)).empty());
}

TEST(LeaseTableTest, TtlBoundsAndThePerTenantCapNameTheirLimits) {
  LeaseLimits limits;
  limits.max_ttl = absl::Seconds(60);
  limits.max_per_tenant = 2;
  LeaseTable leases(limits);
  absl::Status s = leases.Grant("alice", absl::Seconds(61), kT0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("ttl_ms=61000"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("60000"));
  s = leases.Grant("alice", absl::Milliseconds(999), kT0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(leases.Grant("alice", absl::Seconds(60), kT0).ok());
  ASSERT_TRUE(leases.Grant("alice", absl::Seconds(1), kT0).ok());
  s = leases.Grant("alice", absl::Seconds(1), kT0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("--max_leases_per_tenant"));
  EXPECT_TRUE(leases.Grant("bob", absl::Seconds(1), kT0).ok()) << "bob shares alice's cap";
}

TEST(LeaseTableTest, ListShowsTtlAndDeadline) {
  LeaseTable leases(LeaseLimits{});
  auto g = leases.Grant("alice", absl::Seconds(7), kT0);
  ASSERT_TRUE(g.ok());
  auto listed = leases.List("alice", g->id);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].ttl, absl::Seconds(7));
  EXPECT_EQ(listed[0].deadline, kT0 + absl::Seconds(7));
  EXPECT_TRUE(leases.List("bob").empty());
  EXPECT_TRUE(leases.List("alice", g->id + 1).empty());
}

}  // namespace
}  // namespace attnserve
