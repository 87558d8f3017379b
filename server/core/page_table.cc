#include "server/core/page_table.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/core/status_macros.h"

namespace attnserve {

PageTable::PageTable(int32_t num_pages, int32_t tenant_max_pages, bool scrub_freed)
    : tenant_max_pages_(tenant_max_pages),
      scrub_freed_(scrub_freed),
      owner_(num_pages, kFree),
      lease_(num_pages, 0),
      pins_(num_pages, 0),
      plan_pins_(num_pages, 0) {
  free_list_.reserve(num_pages);
  for (int32_t p = num_pages - 1; p >= 0; --p) free_list_.push_back(p);
}

int32_t PageTable::TenantId(absl::string_view tenant) {
  auto [it, inserted] = tenant_ids_.try_emplace(std::string(tenant),
                                                static_cast<int32_t>(tenant_ids_.size()));
  if (inserted) tenant_pages_.push_back(0);
  return it->second;
}

absl::StatusOr<std::vector<int32_t>> PageTable::Allocate(absl::string_view tenant,
                                                         int32_t count, uint64_t lease) {
  absl::MutexLock lock(&mu_);
  const int32_t id = TenantId(tenant);
  if (tenant_max_pages_ > 0 && tenant_pages_[id] + int64_t{count} > tenant_max_pages_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "count=", count, ": tenant holds ", tenant_pages_[id], " pages and may hold at most ",
        tenant_max_pages_));
  }
  if (count > static_cast<int64_t>(free_list_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "count=", count, " exceeds the ", free_list_.size(), " free pages"));
  }
  std::vector<int32_t> pages(free_list_.end() - count, free_list_.end());
  std::reverse(pages.begin(), pages.end());
  free_list_.resize(free_list_.size() - count);
  for (int32_t p : pages) {
    owner_[p] = id;
    lease_[p] = lease;
  }
  tenant_pages_[id] += count;
  return pages;
}

absl::Status PageTable::CheckHeld(int32_t page, int32_t id, uint64_t lease,
                                  absl::string_view what) const {
  const int32_t owner = owner_[page];
  if (owner == id) {
    if (lease != 0 && lease_[page] != lease) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s is not held under lease %#x (it is under %s): a client may use only the pages "
          "of its own lease",
          what, lease, lease_[page] == 0 ? std::string("no lease")
                                         : absl::StrFormat("lease %#x", lease_[page])));
    }
    return absl::OkStatus();
  }
  if (owner < 0) {
    return absl::NotFoundError(
        absl::StrCat(what, " is not allocated (never allocated, or freed since)"));
  }
  return absl::PermissionDeniedError(absl::StrCat(what, " is not owned by this tenant"));
}

void PageTable::FreeOne(int32_t page, int32_t id) {
  lease_[page] = 0;
  if (pins_[page] > 0) {
    owner_[page] = kReleasing;
  } else {
    Release(page);
  }
  --tenant_pages_[id];
}

absl::Status PageTable::Free(absl::string_view tenant, absl::Span<const int32_t> page_ids,
                             uint64_t lease) {
  absl::MutexLock lock(&mu_);
  const int32_t id = TenantId(tenant);
  absl::flat_hash_set<int32_t> seen;
  seen.reserve(page_ids.size());
  for (size_t i = 0; i < page_ids.size(); ++i) {
    const int32_t p = page_ids[i];
    if (p < 0 || p >= num_pages()) {
      return absl::InvalidArgumentError(absl::StrCat("page_ids[", i, "]=", p,
                                                     " out of range [0, ", num_pages(), ")"));
    }
    if (!seen.insert(p).second) {
      return absl::InvalidArgumentError(absl::StrCat("page_ids[", i, "]=", p, " is repeated"));
    }
    ATTN_RETURN_IF_ERROR(CheckHeld(p, id, lease, absl::StrCat("page_ids[", i, "]=", p)));
    if (plan_pins_[p] > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "page_ids[", i, "]=", p, " is held by a plan (CreatePlan): release the plans "
          "that name it (ReleasePlan) before freeing the page (a released plan holds its "
          "pages until the requests running on it finish)"));
    }
  }
  for (int32_t p : page_ids) FreeOne(p, id);
  return absl::OkStatus();
}

std::vector<int32_t> PageTable::FreeHeld(absl::string_view tenant, uint64_t lease) {
  absl::MutexLock lock(&mu_);
  std::vector<int32_t> freed;
  auto it = tenant_ids_.find(tenant);
  if (it == tenant_ids_.end()) return freed;
  const int32_t id = it->second;
  for (int32_t p = 0; p < num_pages(); ++p) {
    if (owner_[p] == id && (lease == 0 || lease_[p] == lease)) {
      FreeOne(p, id);
      freed.push_back(p);
    }
  }
  return freed;
}

std::vector<PageTable::Held> PageTable::List(absl::string_view tenant, uint64_t lease) const {
  absl::MutexLock lock(&mu_);
  std::vector<Held> out;
  auto it = tenant_ids_.find(tenant);
  if (it == tenant_ids_.end()) return out;
  for (int32_t p = 0; p < num_pages(); ++p) {
    if (owner_[p] == it->second && (lease == 0 || lease_[p] == lease)) {
      out.push_back({p, lease_[p]});
    }
  }
  return out;
}

std::string PageTable::PinNames::Of(size_t i, int32_t page) const {
  if (i < kv_count || slots == nullptr) return absl::StrCat(kv_field, "[", i, "]=", page);
  const size_t j = i - kv_count;
  return absl::StrCat(slots_field, "[", j, "]=", slots[j], " (page ", page, ")");
}

absl::Status PageTable::PinOwned(absl::string_view tenant, absl::Span<const int32_t> pages,
                                 const PinNames& names, Holder holder, uint64_t lease) {
  absl::MutexLock lock(&mu_);
  const int32_t id = TenantId(tenant);
  // One pass (requests list thousands of pages); a page of another tenant
  // undoes the pins taken so far.
  for (size_t i = 0; i < pages.size(); ++i) {
    const int32_t p = pages[i];
    if (owner_[p] != id || (lease != 0 && lease_[p] != lease)) {
      for (size_t j = 0; j < i; ++j) {
        --pins_[pages[j]];
        if (holder == Holder::kPlan) --plan_pins_[pages[j]];
      }
      return CheckHeld(p, id, lease, names.Of(i, p));
    }
    ++pins_[p];
    if (holder == Holder::kPlan) ++plan_pins_[p];
  }
  return absl::OkStatus();
}

bool PageTable::Unpin(absl::Span<const int32_t> pages, Holder holder) {
  absl::MutexLock lock(&mu_);
  bool released = false;
  for (int32_t p : pages) {
    if (holder == Holder::kPlan) --plan_pins_[p];
    if (--pins_[p] == 0 && owner_[p] == kReleasing) {
      Release(p);
      released = true;
    }
  }
  return released && scrub_freed_;
}

void PageTable::Release(int32_t page) {
  if (scrub_freed_) {
    owner_[page] = kScrubbing;
    released_.push_back(page);
  } else {
    if (on_free_) on_free_(absl::MakeConstSpan(&page, 1));
    owner_[page] = kFree;
    free_list_.push_back(page);
  }
}

std::vector<int32_t> PageTable::TakeReleased() {
  absl::MutexLock lock(&mu_);
  std::vector<int32_t> out;
  out.swap(released_);
  return out;
}

void PageTable::FinishScrub(absl::Span<const int32_t> pages) {
  absl::MutexLock lock(&mu_);
  std::vector<int32_t> freed;
  freed.reserve(pages.size());
  for (int32_t p : pages) {
    if (owner_[p] == kScrubbing) freed.push_back(p);  // else not ours to free (a caller bug)
  }
  if (on_free_ && !freed.empty()) on_free_(freed);
  for (int32_t p : freed) {
    owner_[p] = kFree;
    free_list_.push_back(p);
  }
}

int32_t PageTable::FreeCount() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(free_list_.size());
}

int32_t PageTable::TenantPages(absl::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = tenant_ids_.find(tenant);
  return it == tenant_ids_.end() ? 0 : tenant_pages_[it->second];
}

int32_t PageTable::OtherTenantsPages(absl::string_view tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = tenant_ids_.find(tenant);
  int32_t total = 0;
  for (size_t id = 0; id < tenant_pages_.size(); ++id) {
    if (it == tenant_ids_.end() || id != static_cast<size_t>(it->second)) total += tenant_pages_[id];
  }
  return total;
}

}  // namespace attnserve
