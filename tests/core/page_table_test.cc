// PageTable: allocation, ownership, quotas, all-or-nothing frees and pins.
#include "server/core/page_table.h"

#include <algorithm>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::set<int32_t> AsSet(const std::vector<int32_t>& v) { return {v.begin(), v.end()}; }

TEST(PageTableTest, AllocatesDistinctPagesInRangeToTheTenant) {
  PageTable pages(16, 0);
  EXPECT_EQ(pages.num_pages(), 16);
  EXPECT_EQ(pages.FreeCount(), 16);
  auto a = pages.Allocate("alice", 5);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = pages.Allocate("bob", 11);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(a->size(), 5u);
  ASSERT_EQ(b->size(), 11u);
  std::set<int32_t> all = AsSet(*a);
  all.insert(b->begin(), b->end());
  EXPECT_EQ(all.size(), 16u) << "a page was handed out twice";
  EXPECT_GE(*all.begin(), 0);
  EXPECT_LT(*all.rbegin(), 16);
  EXPECT_EQ(pages.FreeCount(), 0);
  EXPECT_EQ(pages.TenantPages("alice"), 5);
  EXPECT_EQ(pages.TenantPages("bob"), 11);
  EXPECT_EQ(pages.TenantPages("carol"), 0);
  // Each tenant owns exactly its own pages.
  EXPECT_TRUE(pages.PinOwned("alice", *a, "kv_indices").ok());
  pages.Unpin(*a);
  EXPECT_EQ(pages.PinOwned("alice", {(*b)[0]}, "kv_indices").code(),
            absl::StatusCode::kPermissionDenied);
}

// The free listener (WrittenRows' reset) sees each page as it goes back to
// the free list, before it can be allocated: on Free without scrubbing, at
// the last Unpin of a page freed while pinned, and at FinishScrub with it;
// never at Allocate (a new owner's requests may already be racing that call).
TEST(PageTableTest, TheFreeListenerSeesPagesBeforeTheyCanBeAllocatedAgain) {
  for (bool scrub : {false, true}) {
    SCOPED_TRACE(scrub);
    PageTable pages(4, 0, scrub);
    std::vector<int32_t> seen;
    pages.SetFreeListener([&](absl::Span<const int32_t> p) { seen.insert(seen.end(), p.begin(), p.end()); });
    auto a = pages.Allocate("alice", 4);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(seen.empty());
    ASSERT_TRUE(pages.PinOwned("alice", {(*a)[1]}, "kv_indices").ok());
    ASSERT_TRUE(pages.Free("alice", {(*a)[0], (*a)[1]}).ok());
    if (scrub) {
      EXPECT_TRUE(seen.empty());  // zeroed first
      std::vector<int32_t> released = pages.TakeReleased();
      EXPECT_EQ(released, std::vector<int32_t>{(*a)[0]});
      EXPECT_EQ(pages.FreeCount(), 0);
      pages.FinishScrub(released);
    }
    EXPECT_EQ(seen, std::vector<int32_t>{(*a)[0]});
    EXPECT_EQ(pages.FreeCount(), 1);
    // The pinned page goes at its last Unpin (and its scrub).
    EXPECT_EQ(pages.Unpin({(*a)[1]}), scrub);
    if (scrub) pages.FinishScrub(pages.TakeReleased());
    EXPECT_EQ(seen, (std::vector<int32_t>{(*a)[0], (*a)[1]}));
    EXPECT_EQ(pages.FreeCount(), 2);
    seen.clear();
    ASSERT_TRUE(pages.Allocate("bob", 2).ok());
    EXPECT_TRUE(seen.empty());
  }
}

TEST(PageTableTest, AllocateMoreThanFreeFailsAndChangesNothing) {
  PageTable pages(8, 0);
  ASSERT_TRUE(pages.Allocate("alice", 6).ok());
  auto r = pages.Allocate("bob", 3);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("count=3"));
  EXPECT_EQ(pages.FreeCount(), 2);
  EXPECT_EQ(pages.TenantPages("bob"), 0);
  EXPECT_TRUE(pages.Allocate("bob", 2).ok());
  EXPECT_EQ(pages.FreeCount(), 0);
}

TEST(PageTableTest, QuotaCapsEachTenantSeparately) {
  PageTable pages(32, /*tenant_max_pages=*/5);
  ASSERT_TRUE(pages.Allocate("alice", 3).ok());
  auto over = pages.Allocate("alice", 3);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("at most 5"));
  EXPECT_EQ(pages.TenantPages("alice"), 3);
  EXPECT_EQ(pages.FreeCount(), 29);
  // Another tenant has its own quota.
  auto bob = pages.Allocate("bob", 5);
  ASSERT_TRUE(bob.ok());
  // Up to the cap exactly, and freeing gives quota back.
  auto more = pages.Allocate("alice", 2);
  ASSERT_TRUE(more.ok());
  EXPECT_EQ(pages.Allocate("alice", 1).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(pages.Free("alice", *more).ok());
  EXPECT_TRUE(pages.Allocate("alice", 2).ok());
}

TEST(PageTableTest, OnlyTheOwnerMayFree) {
  PageTable pages(8, 0);
  auto a = pages.Allocate("alice", 2);
  ASSERT_TRUE(a.ok());
  absl::Status s = pages.Free("bob", *a);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(s.message()), HasSubstr("page_ids[0]"));
  EXPECT_EQ(pages.TenantPages("alice"), 2);
  EXPECT_EQ(pages.FreeCount(), 6);
  // A free page is owned by nobody: freeing it again says it is not
  // allocated, not that it is someone else's.
  EXPECT_TRUE(pages.Free("alice", *a).ok());
  s = pages.Free("alice", *a);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("is not allocated"));
}

TEST(PageTableTest, FreeIsAllOrNothing) {
  PageTable pages(8, 0);
  auto a = pages.Allocate("alice", 3);
  auto b = pages.Allocate("bob", 1);
  ASSERT_TRUE(a.ok() && b.ok());
  const int32_t foreign = (*b)[0];
  // One foreign page among own pages: nothing is freed.
  absl::Status s = pages.Free("alice", {(*a)[0], (*a)[1], foreign});
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(s.message()), HasSubstr("page_ids[2]"));
  EXPECT_EQ(pages.FreeCount(), 4);
  EXPECT_EQ(pages.TenantPages("alice"), 3);
  EXPECT_TRUE(pages.PinOwned("alice", *a, "x").ok()) << "alice lost a page in a failed free";
  pages.Unpin(*a);
  // Out of range and repeated ids: INVALID_ARGUMENT naming the entry, nothing freed.
  s = pages.Free("alice", {(*a)[0], 8});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("page_ids[1]=8"));
  s = pages.Free("alice", {(*a)[0], -1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("page_ids[1]=-1"));
  s = pages.Free("alice", {(*a)[2], (*a)[0], (*a)[2]});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("repeated"));
  EXPECT_EQ(pages.FreeCount(), 4);
  EXPECT_EQ(pages.TenantPages("alice"), 3);
}

TEST(PageTableTest, PinOwnedIsAllOrNothing) {
  PageTable pages(8, 0);
  auto a = pages.Allocate("alice", 2);
  auto b = pages.Allocate("bob", 1);
  ASSERT_TRUE(a.ok() && b.ok());
  absl::Status s = pages.PinOwned("alice", {(*a)[0], (*b)[0]}, "kv_indices");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("kv_indices[1]=", (*b)[0], " is not owned")));
  // The failed pin left (*a)[0] unpinned: freeing it returns it at once.
  ASSERT_TRUE(pages.Free("alice", {(*a)[0]}).ok());
  EXPECT_EQ(pages.FreeCount(), 6);
}

// An error names the entry that failed: its field, its index and its value
// (for a slot, the slot and its page), not only the page.
TEST(PageTableTest, PinErrorsNameTheEntry) {
  PageTable pages(8, 0);
  auto a = pages.Allocate("alice", 2);
  ASSERT_TRUE(a.ok());
  int32_t unallocated = 0;
  while (unallocated == (*a)[0] || unallocated == (*a)[1]) ++unallocated;
  // Pages [a0, a1] from kv_indices, then two append slots' pages (page size 16).
  const int64_t slots[] = {int64_t{(*a)[1]} * 16 + 3, int64_t{unallocated} * 16 + 5};
  absl::Status s = pages.PinOwned("alice", {(*a)[0], (*a)[1], (*a)[1], unallocated},
                                  {"kv_indices", 2, "append_slots", slots});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("append_slots[1]=", slots[1], " (page ", unallocated, ") is not allocated")));
  s = pages.PinOwned("alice", {(*a)[0], unallocated}, {"kv_indices", 2, "append_slots", slots});
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("kv_indices[1]=", unallocated, " is not allocated")));
  const int64_t write_slots[] = {int64_t{unallocated} * 16};
  s = pages.PinOwned("alice", {unallocated}, {"slots", 0, "slots", write_slots});
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("slots[0]=", write_slots[0], " (page ", unallocated, ") is not allocated")));
  // Nothing stayed pinned: both pages free at once.
  ASSERT_TRUE(pages.Free("alice", *a).ok());
  EXPECT_EQ(pages.FreeCount(), 8);
}

TEST(PageTableTest, PageFreedWhilePinnedIsNotReallocatedUntilUnpinned) {
  PageTable pages(4, 0);
  auto a = pages.Allocate("alice", 2);
  ASSERT_TRUE(a.ok());
  const int32_t pinned = (*a)[0];
  ASSERT_TRUE(pages.PinOwned("alice", {pinned}, "kv_indices").ok());
  ASSERT_TRUE(pages.PinOwned("alice", {pinned}, "kv_indices").ok());  // two requests
  ASSERT_TRUE(pages.Free("alice", *a).ok());
  // The owner lost it at once...
  EXPECT_EQ(pages.TenantPages("alice"), 0);
  EXPECT_EQ(pages.PinOwned("alice", {pinned}, "kv_indices").code(),
            absl::StatusCode::kNotFound);
  // ...but it is not free while pinned: only the unpinned page came back.
  EXPECT_EQ(pages.FreeCount(), 3);
  auto b = pages.Allocate("bob", 3);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(AsSet(*b).count(pinned), 0u) << "a pinned page was handed to another tenant";
  EXPECT_EQ(pages.Allocate("bob", 1).status().code(), absl::StatusCode::kResourceExhausted);
  pages.Unpin({pinned});
  EXPECT_EQ(pages.FreeCount(), 0) << "freed with one pin still held";
  pages.Unpin({pinned});
  EXPECT_EQ(pages.FreeCount(), 1);
  auto c = pages.Allocate("carol", 1);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)[0], pinned);
}

// One request may list a page several times (validation does not dedupe):
// each occurrence is one pin, and the same list unpinned releases them all.
TEST(PageTableTest, RepeatedPagesInOneListArePinnedPerOccurrence) {
  PageTable pages(4, 0);
  auto a = pages.Allocate("alice", 2);
  ASSERT_TRUE(a.ok());
  const std::vector<int32_t> list = {(*a)[1], (*a)[0], (*a)[1], (*a)[1]};
  ASSERT_TRUE(pages.PinOwned("alice", list, "kv_indices").ok());
  ASSERT_TRUE(pages.Free("alice", *a).ok());
  EXPECT_EQ(pages.FreeCount(), 2) << "pinned pages came back while in use";
  pages.Unpin(list);
  EXPECT_EQ(pages.FreeCount(), 4) << "the list's pins were not all released";
  // A list holding a page of another tenant pins nothing.
  auto b = pages.Allocate("bob", 1);
  auto c = pages.Allocate("carol", 1);
  ASSERT_TRUE(b.ok() && c.ok());
  EXPECT_EQ(pages.PinOwned("bob", {(*b)[0], (*b)[0], (*c)[0]}, "kv_indices").code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(pages.Free("bob", *b).ok());
  EXPECT_EQ(pages.FreeCount(), 3) << "a refused PinOwned left a pin behind";
}

// With scrub_freed, a freed page is handed out again only after FinishScrub:
// freed unpinned pages at once, pinned ones when their last pin goes, each
// returned by TakeReleased exactly once.
TEST(PageTableTest, ScrubbedTableFreesPagesOnlyAfterFinishScrub) {
  PageTable pages(4, 0, /*scrub_freed=*/true);
  auto a = pages.Allocate("alice", 4);
  ASSERT_TRUE(a.ok());
  const int32_t pinned = (*a)[3];
  ASSERT_TRUE(pages.PinOwned("alice", {pinned}, "kv_indices").ok());
  ASSERT_TRUE(pages.Free("alice", *a).ok());
  EXPECT_EQ(pages.FreeCount(), 0) << "freed pages are free before they are zeroed";
  EXPECT_EQ(pages.Allocate("bob", 1).status().code(), absl::StatusCode::kResourceExhausted);
  std::vector<int32_t> released = pages.TakeReleased();
  EXPECT_EQ(AsSet(released), (std::set<int32_t>{(*a)[0], (*a)[1], (*a)[2]}));
  EXPECT_TRUE(pages.TakeReleased().empty()) << "a released page was returned twice";
  pages.FinishScrub(released);
  EXPECT_EQ(pages.FreeCount(), 3);
  // The pinned page follows when its pin goes, and Unpin says so.
  EXPECT_TRUE(pages.Unpin({pinned}));
  EXPECT_EQ(pages.FreeCount(), 3);
  EXPECT_EQ(pages.TakeReleased(), std::vector<int32_t>{pinned});
  // FinishScrub of a page that is not being scrubbed changes nothing.
  pages.FinishScrub({(*a)[0]});
  EXPECT_EQ(pages.FreeCount(), 3);
  pages.FinishScrub({pinned});
  EXPECT_EQ(pages.FreeCount(), 4);
  auto b = pages.Allocate("bob", 4);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(AsSet(*b).count(pinned), 1u);
}

TEST(PageTableTest, UnpinOfAnOwnedPageKeepsItOwned) {
  PageTable pages(4, 0);
  auto a = pages.Allocate("alice", 1);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(pages.PinOwned("alice", *a, "slots").ok());
  pages.Unpin(*a);
  EXPECT_EQ(pages.FreeCount(), 3);
  EXPECT_EQ(pages.TenantPages("alice"), 1);
  EXPECT_TRUE(pages.PinOwned("alice", *a, "slots").ok());
  pages.Unpin(*a);
}

TEST(PageTableTest, ConcurrentAllocateAndFreeNeverShareAPage) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 300;
  PageTable pages(64, 0);
  std::vector<std::vector<int32_t>> held(kThreads);
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::string tenant = "tenant" + std::to_string(t);
      for (int r = 0; r < kRounds; ++r) {
        auto got = pages.Allocate(tenant, 1 + r % 3);
        if (!got.ok()) continue;  // momentarily out of pages
        held[t].insert(held[t].end(), got->begin(), got->end());
        if (!pages.PinOwned(tenant, *got, "x").ok()) ++failures[t];
        pages.Unpin(*got);
        if (held[t].size() > 4) {
          if (!pages.Free(tenant, held[t]).ok()) ++failures[t];
          held[t].clear();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  std::set<int32_t> all;
  size_t total = 0;
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failures[t], 0) << "thread " << t << " lost a page it held";
    all.insert(held[t].begin(), held[t].end());
    total += held[t].size();
    EXPECT_EQ(pages.TenantPages("tenant" + std::to_string(t)), static_cast<int32_t>(held[t].size()));
  }
  EXPECT_EQ(all.size(), total) << "two tenants hold the same page";
  EXPECT_EQ(pages.FreeCount(), 64 - static_cast<int32_t>(total));
}

// Pages held under a lease: a request naming the lease may use only its
// pages, FreeHeld frees exactly them (whatever plans pin them), and List
// shows each page with its lease.
TEST(PageTableTest, LeasedPagesAreUsedOnlyUnderTheirLeaseAndFreedWithIt) {
  PageTable pages(16, 0);
  auto l1 = pages.Allocate("alice", 3, /*lease=*/11);
  auto l2 = pages.Allocate("alice", 2, /*lease=*/22);
  auto none = pages.Allocate("alice", 1);
  auto bob = pages.Allocate("bob", 2, /*lease=*/11);  // ids are per server: bob's 11 is not alice's
  ASSERT_TRUE(l1.ok() && l2.ok() && none.ok() && bob.ok());
  EXPECT_TRUE(pages.PinOwned("alice", *l1, "kv_indices", PageTable::Holder::kRequest, 11).ok());
  pages.Unpin(*l1);
  absl::Status s =
      pages.PinOwned("alice", {(*l1)[0], (*l2)[1]}, "kv_indices", PageTable::Holder::kRequest, 11);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("kv_indices[1]=", (*l2)[1], " is not held")));
  EXPECT_THAT(std::string(s.message()), HasSubstr("not held under lease 0xb"));
  EXPECT_EQ(pages.PinOwned("alice", *none, "kv_indices", PageTable::Holder::kRequest, 11).code(),
            absl::StatusCode::kFailedPrecondition);
  // Without a lease, every page of the tenant is usable (as before leases).
  EXPECT_TRUE(pages.PinOwned("alice", {(*l1)[0], (*l2)[0], (*none)[0]}, "x").ok());
  pages.Unpin({(*l1)[0], (*l2)[0], (*none)[0]});
  // Free under a lease: only its pages, all or nothing.
  s = pages.Free("alice", {(*l2)[0], (*l1)[0]}, 22);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("page_ids[1]"));
  EXPECT_EQ(pages.TenantPages("alice"), 6);

  std::vector<PageTable::Held> listed = pages.List("alice", 22);
  ASSERT_EQ(listed.size(), 2u);
  for (const auto& h : listed) EXPECT_EQ(h.lease, 22u);
  EXPECT_EQ(pages.List("alice").size(), 6u);

  // A plan pins lease 11's first page; the lease's end frees it anyway, and
  // it comes back once the plan lets go.
  ASSERT_TRUE(pages.PinOwned("alice", {(*l1)[0]}, "x", PageTable::Holder::kPlan, 11).ok());
  const int32_t free_before = pages.FreeCount();
  std::vector<int32_t> freed = pages.FreeHeld("alice", 11);
  std::vector<int32_t> want = *l1;
  std::sort(want.begin(), want.end());
  EXPECT_EQ(freed, want);
  EXPECT_EQ(pages.FreeCount(), free_before + 2) << "the plan-pinned page came back too early";
  EXPECT_EQ(pages.TenantPages("alice"), 3);
  EXPECT_EQ(pages.TenantPages("bob"), 2) << "another tenant's lease 11 was freed";
  pages.Unpin({(*l1)[0]}, PageTable::Holder::kPlan);
  EXPECT_EQ(pages.FreeCount(), free_before + 3);
  // Lease 0: everything the tenant holds.
  freed = pages.FreeHeld("alice", 0);
  EXPECT_EQ(freed.size(), 3u);
  EXPECT_EQ(pages.TenantPages("alice"), 0);
  EXPECT_TRUE(pages.List("alice").empty());
  // A page handed out again carries the new allocation's lease only.
  auto again = pages.Allocate("alice", 10);
  ASSERT_TRUE(again.ok());
  for (const auto& h : pages.List("alice")) EXPECT_EQ(h.lease, 0u);
}

TEST(PageTableTest, APlanHeldPageNamesThePlanNotThePinCount) {
  PageTable pages(4, 0);
  auto a = pages.Allocate("alice", 1);
  ASSERT_TRUE(a.ok());
  // One plan naming the page twice (two sequences' pages) pins it twice.
  ASSERT_TRUE(pages.PinOwned("alice", {(*a)[0], (*a)[0]}, "x", PageTable::Holder::kPlan).ok());
  absl::Status s = pages.Free("alice", *a);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("held by a plan"));
  EXPECT_THAT(std::string(s.message()), Not(HasSubstr("2 plan")));
}

}  // namespace
}  // namespace attnserve
