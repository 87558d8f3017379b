// The KvManager's lease and what failed calls leave in doubt: the
// reconciliation against the lease's holdings (ListHoldings), the frees of
// pages no sequence owns, the release of stale server plans, and what a
// lost lease, a restart or an unreachable server does to the bookkeeping
// (docs/kv_manager.md, "When a call fails"). kv_manager.cc has the steps:
// Plan, Run, Undo, Finish, Release.
#include <algorithm>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "client/kv_manager.h"
#include "client/kv_manager_internal.h"

namespace attnserve {

using kv_manager_detail::kLeaseGone;
using kv_manager_detail::Prefixed;

absl::Status KvManager::ReleaseStale() {
  while (!unreleased_.empty()) {
    absl::Status s = rpc()->ReleasePlan(unreleased_.back());
    // NOT_FOUND: the server dropped it already (idle timeout or restart).
    // Plan ids are random and never reused, so a release whose outcome is
    // unknown is simply tried again.
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) return s;
    unreleased_.pop_back();
  }
  return absl::OkStatus();
}

absl::flat_hash_set<uint64_t> KvManager::LivePlanIds() const {
  absl::flat_hash_set<uint64_t> ids;
  for (const auto& [id, s] : seqs_) {
    if (s.plan != nullptr && s.plan->plan_id != 0 && live_steps_.contains(s.plan->step)) {
      ids.insert(s.plan->plan_id);
    }
  }
  return ids;
}

void KvManager::EndLease() {
  if (keeper_ != nullptr) keeper_->Abandon();
  keeper_.reset();
}

std::vector<int64_t> KvManager::LoseAll() {
  std::vector<int64_t> lost;
  for (const auto& [id, s] : seqs_) {
    lost.push_back(id);
    lost_.insert(id);
  }
  std::sort(lost.begin(), lost.end());
  seqs_.clear();
  live_steps_.clear();
  ran_layers_.clear();
  unreleased_.clear();
  latest_.reset();
  to_free_.clear();
  dirty_ = false;
  EndLease();  // gone already
  return lost;
}

void KvManager::ClearBookkeeping() {
  seqs_.clear();
  live_steps_.clear();
  ran_layers_.clear();
  unreleased_.clear();
  latest_.reset();
  lost_.clear();
  to_free_.clear();
  dirty_ = false;
}

void KvManager::Reset(bool restarted) {
  // The lease found gone, most likely; revoking it again costs nothing if so.
  if (!restarted && keeper_ != nullptr) unrevoked_.push_back(keeper_->id());
  ClearBookkeeping();
  EndLease();
  if (restarted) unrevoked_.clear();  // the server that restarted has none of them
}

void KvManager::Abandon() {
  if (keeper_ == nullptr) {
    leaked_ += NumPages() + static_cast<int64_t>(to_free_.size());
  } else {
    unrevoked_.push_back(keeper_->id());  // if the server answers again
  }
  ClearBookkeeping();
  EndLease();
}

absl::Status KvManager::Failed(const absl::Status& s, int64_t leak_if_unknown) {
  if (IsLeaseExpired(s)) {
    std::vector<int64_t> lost = LoseAll();
    return lost.empty() ? s : SequencesLostError(lost, kLeaseGone);
  }
  if (IsStaleIncarnation(s)) return s;  // the server restarted: nothing is held there
  if (OutcomeUnknown(s)) {
    if (keeper_ != nullptr) {
      dirty_ = true;
    } else {
      leaked_ += leak_if_unknown;
    }
  }
  return s;
}

absl::Status KvManager::Prepare() {
  if (!options_.lease) {
    if (!to_free_.empty()) FreePending();
    return absl::OkStatus();
  }
  if (keeper_ != nullptr && keeper_->expired()) {
    std::vector<int64_t> lost = LoseAll();
    if (!lost.empty()) return SequencesLostError(lost, kLeaseGone);
  }
  if (keeper_ != nullptr && dirty_) {
    absl::Status s = Reconcile();
    // A loss stops the plan; holdings left in doubt do not: they are the
    // lease's, which no one else can be given, and a later call reconciles
    // them. A lease found gone with no sequence under it: a new one below.
    if (s.code() == absl::StatusCode::kDataLoss || IsStaleIncarnation(s)) return s;
  }
  if (keeper_ == nullptr) {
    // Leases ended while the server did not answer: revoked now, best
    // effort (they also end by themselves within their ttl).
    RevokeEnded().IgnoreError();
    // A fresh fork: it takes the client's incarnation as it is now (the
    // caller's after a restart).
    own_ = client_->Fork();
    auto keeper = LeaseKeeper::Start(own_.get(), options_.lease_ttl_ms);
    if (keeper.ok()) {
      keeper_ = *std::move(keeper);
    } else if (keeper.status().code() == absl::StatusCode::kUnimplemented) {
      options_.lease = false;  // a server without leases: as before them
      own_.reset();
    } else {
      return keeper.status();
    }
  }
  return absl::OkStatus();
}

absl::Status KvManager::Reconcile() {
  const uint64_t lease = keeper_->id();
  auto listed = rpc()->ListHoldings(lease);
  if (!listed.ok()) return Failed(listed.status());
  absl::flat_hash_set<int32_t> held_pages;
  std::vector<uint64_t> held_plans;
  for (const v1::LeaseInfo& l : listed->leases()) {
    if (l.lease_id() != lease) continue;
    held_pages.insert(l.holdings().page_ids().begin(), l.holdings().page_ids().end());
    held_plans.assign(l.holdings().plan_ids().begin(), l.holdings().plan_ids().end());
  }
  // Plans first: a plan pins its pages. Every plan the lease holds that is
  // not a live plan goes (stale ones, and one whose CreatePlan reply was lost).
  const absl::flat_hash_set<uint64_t> live = LivePlanIds();
  for (uint64_t id : held_plans) {
    if (live.contains(id)) continue;
    absl::Status s = rpc()->ReleasePlan(id);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) return Failed(s);
  }
  unreleased_.clear();
  // Then every page no live sequence owns (one whose FreePages reply was
  // lost, or whose AllocatePages reply was).
  absl::flat_hash_set<int32_t> owned;
  std::vector<int64_t> missing;
  for (const auto& [id, s] : seqs_) {
    bool whole = true;
    for (int32_t p : s.pages) {
      owned.insert(p);
      whole = whole && held_pages.contains(p);
    }
    if (!whole) missing.push_back(id);
  }
  std::vector<int32_t> unowned;
  for (int32_t p : held_pages) {
    if (!owned.contains(p)) unowned.push_back(p);
  }
  std::sort(unowned.begin(), unowned.end());
  if (!unowned.empty()) {
    absl::Status s = rpc()->FreePages(unowned);
    if (!s.ok()) return Failed(s);
  }
  dirty_ = false;
  if (!missing.empty()) {
    // Pages of a live sequence that the lease no longer holds: something
    // freed them behind the manager's back. Never attend over them again.
    // The other sequences of their plans keep their rows, but the layers of
    // that step that had not run can no longer run for them.
    const absl::flat_hash_set<int64_t> gone(missing.begin(), missing.end());
    for (int64_t id : missing) {
      const std::shared_ptr<const StepPlan>& plan = seqs_.find(id)->second.plan;
      if (plan != nullptr) MarkUnrun(*plan, gone);
    }
    for (int64_t id : missing) {
      auto it = seqs_.find(id);
      Retire(it->second.plan);
      seqs_.erase(it);
      lost_.insert(id);
    }
    return SequencesLostError(missing, "pages of theirs are no longer held under the lease");
  }
  return absl::OkStatus();
}

void KvManager::FreePending() {
  std::vector<int32_t> pages = std::move(to_free_);
  to_free_.clear();
  if (!ReleaseStale().ok()) {
    to_free_ = std::move(pages);
    return;
  }
  absl::Status s = rpc()->FreePages(pages);
  if (s.ok() || IsStaleIncarnation(s)) return;
  if (OutcomeUnknown(s) || s.code() != absl::StatusCode::kFailedPrecondition) {
    leaked_ += static_cast<int64_t>(pages.size());  // never freed twice
  } else {
    to_free_ = std::move(pages);  // still pinned by a plan: the next call tries again
  }
}

absl::Status KvManager::FreeUnowned(std::vector<int32_t> pages) {
  // Without a lease of its own any more, a lease-mode manager holds nothing:
  // what it held went with the lease.
  if (options_.lease && keeper_ == nullptr) return absl::OkStatus();
  if (keeper_ != nullptr) {
    // With the lease every failure is settled by the next reconciliation:
    // what the lease still holds and no sequence owns is freed then.
    absl::Status s;
    if (dirty_) {
      s = Reconcile();  // frees `pages` too: the lease holds them, no sequence owns them
    } else {
      s = ReleaseStale();
      if (s.ok() && !pages.empty()) s = rpc()->FreePages(pages);
    }
    if (s.ok() || s.code() == absl::StatusCode::kDataLoss) return s;
    if (IsLeaseExpired(s) || IsStaleIncarnation(s)) return Failed(s);
    dirty_ = true;
    return Prefixed(s,
                    "the manager frees what its lease still holds and no sequence owns at its "
                    "next Plan(), Finish() or Release() (the server, when the lease ends): ");
  }
  // Without a lease, a FreePages whose outcome is unknown is never tried
  // again: the pages may belong to another client of the tenant by now.
  absl::Status s = ReleaseStale();
  if (!s.ok()) {
    if (IsLeaseExpired(s) || IsStaleIncarnation(s)) return Failed(s);
    // The stale plans pin the pages, which are surely still held.
    to_free_.insert(to_free_.end(), pages.begin(), pages.end());
    return Prefixed(s, "the pages are freed at a later call, once their plans are released: ");
  }
  if (!pages.empty()) {
    s = rpc()->FreePages(pages);
    if (!s.ok()) {
      if (IsLeaseExpired(s) || IsStaleIncarnation(s)) return Failed(s);
      if (!OutcomeUnknown(s) && s.code() == absl::StatusCode::kFailedPrecondition) {
        // Pinned by a plan whose CreatePlan reply was lost: the server drops
        // it after --plan_idle_timeout_s.
        to_free_.insert(to_free_.end(), pages.begin(), pages.end());
        return Prefixed(s, "the pages are freed at a later call, once the plans that pin them "
                           "are gone: ");
      }
      leaked_ += static_cast<int64_t>(pages.size());
      return Prefixed(s, "pages that may or may not have been freed are leaked (Leaked()), "
                         "never freed or reused: ");
    }
  }
  if (!to_free_.empty()) FreePending();
  return absl::OkStatus();
}

absl::Status KvManager::RevokeEnded() {
  while (!unrevoked_.empty()) {
    auto released = rpc()->RevokeLease(unrevoked_.back());
    // A lease that is gone already is no error; a server that restarted
    // holds none of them.
    if (!released.ok() && !IsStaleIncarnation(released.status())) return released.status();
    if (!released.ok()) {
      unrevoked_.clear();
      break;
    }
    unrevoked_.pop_back();
  }
  return absl::OkStatus();
}

}  // namespace attnserve
