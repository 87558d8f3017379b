// PageTable: which tenant owns each KV page, and which pages queued work
// still reads.
//
// Every request pins the pages it touches (atomically with the ownership
// check) before it is queued and unpins them when it finishes. A page freed
// while pinned leaves its owner at once but returns to the free list only
// when the last pin goes, so no in-flight request ever reads a page that has
// meanwhile been handed to another tenant.
//
// A page may be held under a lease (lease_table.h): then a request that
// names the lease may use only the lease's pages, and the lease's end frees
// them all (FreeHeld).
//
//   PageTable pages(/*num_pages=*/1024, /*tenant_max_pages=*/0);
//   auto ids = pages.Allocate("default", 4);          // {0, 1, 2, 3}
//   pages.PinOwned("default", {1, 2}, "kv_indices");  // OK
//   pages.Unpin({1, 2});
//   pages.Free("default", *ids);
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace attnserve {

class PageTable {
 public:
  // tenant_max_pages: most pages one tenant may hold; 0 means no cap.
  // scrub_freed: a freed page (once unpinned) does not go back to the free
  // list but waits in TakeReleased() until FinishScrub() says its KV rows
  // were zeroed, so that no tenant can read what another left behind.
  PageTable(int32_t num_pages, int32_t tenant_max_pages, bool scrub_freed = false);

  // Hands `count` free pages to `tenant`, held under `lease` (0: none).
  // RESOURCE_EXHAUSTED when too few are free or the tenant's cap would be
  // passed; nothing changes then.
  absl::StatusOr<std::vector<int32_t>> Allocate(absl::string_view tenant, int32_t count,
                                                uint64_t lease = 0);

  // Frees pages of `tenant`. All or nothing: INVALID_ARGUMENT for an id out of
  // range or repeated, NOT_FOUND for a page that is not allocated,
  // PERMISSION_DENIED for another tenant's page, FAILED_PRECONDITION for a
  // page a plan holds or, when `lease` is non-zero, one not held under it.
  absl::Status Free(absl::string_view tenant, absl::Span<const int32_t> page_ids,
                    uint64_t lease = 0);

  // Frees every page `tenant` holds under `lease` (lease 0: every page the
  // tenant holds, leased or not), whatever plans hold them (the caller
  // released those plans: pins that remain are requests' or plans still in
  // use by one, and the pages wait for them as Free's do). Returns the ids,
  // ascending.
  std::vector<int32_t> FreeHeld(absl::string_view tenant, uint64_t lease);

  // The pages `tenant` holds, ascending, each with its lease (0: none); with
  // a non-zero `lease`, only that lease's.
  struct Held {
    int32_t page = 0;
    uint64_t lease = 0;
  };
  std::vector<Held> List(absl::string_view tenant, uint64_t lease = 0) const;

  // How an error names entry i (page p) of a list to pin: the first
  // kv_count entries as "kv_indices[i]=p", the rest as the pages of
  // `slots_field`'s slots: "append_slots[j]=s (page p)". A field alone
  // names every entry "field[i]=p".
  struct PinNames {
    PinNames(const char* field) : kv_field(field) {}  // NOLINT: a field alone, implicitly
    PinNames(absl::string_view field) : kv_field(field) {}  // NOLINT
    PinNames(absl::string_view kv_field, size_t kv_count, absl::string_view slots_field,
             const int64_t* slots)
        : kv_field(kv_field), kv_count(kv_count), slots_field(slots_field), slots(slots) {}
    std::string Of(size_t i, int32_t page) const;

    absl::string_view kv_field;
    size_t kv_count = SIZE_MAX;
    absl::string_view slots_field;
    const int64_t* slots = nullptr;
  };

  // Who holds a pin: a request in flight, or a plan (CreatePlan). A page a
  // plan holds cannot be freed (FAILED_PRECONDITION) until the plan lets go.
  enum class Holder { kRequest, kPlan };

  // Checks that every page (in range) belongs to `tenant` (and, when `lease`
  // is non-zero, is held under it) and pins them all, or pins none and
  // returns an error naming the entry (`names`): NOT_FOUND for a page that is not
  // allocated, PERMISSION_DENIED for another tenant's, FAILED_PRECONDITION
  // for one not under the lease. Pins are counts: a page listed n times is
  // pinned n times, and Unpin of the same list (and holder) releases them.
  absl::Status PinOwned(absl::string_view tenant, absl::Span<const int32_t> pages,
                        const PinNames& names, Holder holder = Holder::kRequest,
                        uint64_t lease = 0);
  // True when a page freed while pinned was released for scrubbing (then
  // TakeReleased has work).
  bool Unpin(absl::Span<const int32_t> pages, Holder holder = Holder::kRequest);

  // With scrub_freed: the pages freed and unpinned since the last call; each
  // is returned once and stays out of the free list until FinishScrub.
  std::vector<int32_t> TakeReleased();
  // Pages from TakeReleased whose KV rows are now zero: they become free.
  void FinishScrub(absl::Span<const int32_t> pages);

  // Called, under the table's lock, with pages about to go back to the free
  // list (their previous owner's bookkeeping is cleared there, before anyone
  // can allocate them: WrittenRows). Set once, before the table is shared;
  // it must not call back into the table.
  using FreeListener = std::function<void(absl::Span<const int32_t>)>;
  void SetFreeListener(FreeListener listener) { on_free_ = std::move(listener); }

  int32_t num_pages() const { return static_cast<int32_t>(owner_.size()); }
  int32_t FreeCount() const;
  int32_t TenantPages(absl::string_view tenant) const;
  // Pages every tenant but `tenant` holds.
  int32_t OtherTenantsPages(absl::string_view tenant) const;

 private:
  static constexpr int32_t kFree = -1;
  static constexpr int32_t kReleasing = -2;  // freed by its owner, still pinned
  static constexpr int32_t kScrubbing = -3;  // freed and unpinned, not yet zeroed

  // A freed, unpinned page: to the free list, or to released_ for scrubbing.
  void Release(int32_t page) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees one page the caller checked (owner id `id`).
  void FreeOne(int32_t page, int32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why `page` may not be used by tenant `id` under `lease`, naming it as
  // `what` (e.g. "kv_indices[3]=7"); OK when it may.
  absl::Status CheckHeld(int32_t page, int32_t id, uint64_t lease, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  int32_t TenantId(absl::string_view tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int32_t tenant_max_pages_;
  const bool scrub_freed_;
  FreeListener on_free_;
  mutable absl::Mutex mu_;
  std::vector<int32_t> owner_ ABSL_GUARDED_BY(mu_);  // tenant id, kFree, kReleasing or kScrubbing
  std::vector<uint64_t> lease_ ABSL_GUARDED_BY(mu_);  // of an owned page; 0: none
  // 64-bit: a request may list one page 4M times, and thousands of them may
  // be queued at once (in 32 bits the count could wrap to 0 and let the page
  // be freed and given to another tenant while requests still use it).
  std::vector<int64_t> pins_ ABSL_GUARDED_BY(mu_);       // all holders
  std::vector<int64_t> plan_pins_ ABSL_GUARDED_BY(mu_);  // the plans' share of pins_
  std::vector<int32_t> free_list_ ABSL_GUARDED_BY(mu_);  // a stack
  std::vector<int32_t> released_ ABSL_GUARDED_BY(mu_);   // awaiting TakeReleased
  absl::flat_hash_map<std::string, int32_t> tenant_ids_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> tenant_pages_ ABSL_GUARDED_BY(mu_);  // by tenant id
};

}  // namespace attnserve
