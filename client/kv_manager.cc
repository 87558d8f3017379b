#include "client/kv_manager.h"
#include "client/kv_manager_internal.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace attnserve {
namespace {

constexpr char kLostUrl[] = "type.attnserve.dev/attnserve.LostSequences";

}  // namespace

using kv_manager_detail::kLeaseGone;
using kv_manager_detail::Prefixed;

absl::Status SequencesLostError(absl::Span<const int64_t> seq_ids, absl::string_view why) {
  std::vector<int64_t> sorted(seq_ids.begin(), seq_ids.end());
  std::sort(sorted.begin(), sorted.end());
  absl::Status s = absl::DataLossError(
      absl::StrCat("sequences lost: ", absl::StrJoin(sorted, ", "), " (", why,
                   "); Finish() them and start them again"));
  s.SetPayload(kLostUrl, absl::Cord(absl::StrJoin(sorted, ",")));
  return s;
}

std::vector<int64_t> LostSequences(const absl::Status& status) {
  std::vector<int64_t> ids;
  if (status.code() != absl::StatusCode::kDataLoss) return ids;
  auto payload = status.GetPayload(kLostUrl);
  if (!payload.has_value()) return ids;
  for (absl::string_view part : absl::StrSplit(std::string(*payload), ',', absl::SkipEmpty())) {
    int64_t id;
    if (absl::SimpleAtoi(part, &id)) ids.push_back(id);
  }
  return ids;
}

KvManager::KvManager(Client* client, KvManagerOptions options)
    : client_(client), options_(options), page_size_(client->info().page_size()) {}

// keeper_'s destructor revokes the lease (before own_, which it uses, goes).
KvManager::~KvManager() = default;

void KvManager::Retire(const std::shared_ptr<const StepPlan>& plan) {
  if (plan == nullptr || !live_steps_.erase(plan->step)) return;
  ran_layers_.erase(plan->step);
  if (plan->plan_id != 0) unreleased_.push_back(plan->plan_id);
}

void KvManager::MarkUnrun(const StepPlan& plan, const absl::flat_hash_set<int64_t>& gone) {
  auto ran = ran_layers_.find(plan.step);
  if (ran == ran_layers_.end()) return;  // not live
  std::vector<int32_t> unrun;
  for (int32_t layer = 0; layer < client_->info().num_layers(); ++layer) {
    if (!std::binary_search(ran->second.begin(), ran->second.end(), layer)) unrun.push_back(layer);
  }
  if (unrun.empty()) return;
  for (size_t b = 0; b < plan.seq_ids.size(); ++b) {
    if (plan.append_lens[b] == 0 || gone.contains(plan.seq_ids[b])) continue;
    auto it = seqs_.find(plan.seq_ids[b]);
    if (it == seqs_.end() || it->second.plan.get() != &plan) continue;
    std::vector<int32_t>& unwritten = it->second.unwritten;
    std::vector<int32_t> merged;
    std::set_union(unwritten.begin(), unwritten.end(), unrun.begin(), unrun.end(),
                   std::back_inserter(merged));
    unwritten = std::move(merged);
  }
}

bool KvManager::IsLatestPlan(const StepPlan* plan) const {
  if (plan->seq_ids.empty()) return false;
  auto it = seqs_.find(plan->seq_ids[0]);
  return it != seqs_.end() && it->second.plan.get() == plan;
}

absl::Status KvManager::CheckWritten(absl::Span<const int64_t> seq_ids) const {
  // (step, layers) -> sequences; apart, those whose plan went stale (Finish()
  // or the loss of another of its sequences), which no Run() can write again.
  std::map<std::pair<int64_t, std::vector<int32_t>>, std::vector<int64_t>> groups, stale;
  for (int64_t id : seq_ids) {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || it->second.unwritten.empty()) continue;
    const StepPlan* plan = it->second.plan.get();
    const int64_t step = plan == nullptr ? 0 : plan->step;
    const bool live = plan != nullptr && live_steps_.contains(step);
    (live ? groups : stale)[{step, it->second.unwritten}].push_back(id);
  }
  if (groups.empty() && stale.empty()) return absl::OkStatus();
  auto describe = [](const auto& of) {
    std::vector<std::string> parts;
    for (const auto& [key, ids] : of) {
      parts.push_back(absl::StrCat("sequences ", absl::StrJoin(ids, ", "), ": layer",
                                   key.second.size() > 1 ? "s " : " ",
                                   absl::StrJoin(key.second, ", "), " of step ", key.first));
    }
    return absl::StrJoin(parts, "; ");
  };
  std::vector<std::string> says;
  if (!groups.empty()) {
    says.push_back(absl::StrCat(
        describe(groups),
        ": a Run() of that layer failed, and it may or may not have appended the step's K/V "
        "rows; run that layer of that plan again (with the same q, k_new, v_new) or Finish() "
        "the sequences"));
  }
  if (!stale.empty()) {
    says.push_back(absl::StrCat(
        describe(stale),
        ": a Run() of that layer failed or never completed, and that plan can no longer run "
        "(Finish() of another of its sequences, or its loss, made it stale), so their K/V of "
        "that step may never be written: Finish() the sequences"));
  }
  return absl::FailedPreconditionError(absl::StrJoin(says, "; and "));
}

absl::StatusOr<std::shared_ptr<const StepPlan>> KvManager::Plan(
    absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens) {
  return PlanRows(seq_ids, q_lens, q_lens, {});
}

const AttentionOptions& KvManager::AttentionOf(int32_t layer) const {
  auto it = options_.layer_attention.find(layer);
  return it == options_.layer_attention.end() ? options_.attention : it->second;
}

absl::StatusOr<std::shared_ptr<const StepPlan>> KvManager::PlanRows(
    absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> append_lens,
    absl::Span<const int32_t> q_rows, absl::Span<const int32_t> kv_keys_after,
    absl::Span<const uint8_t> apply_sinks) {
  auto plan = PlanOnce(seq_ids, append_lens, q_rows, kv_keys_after, apply_sinks);
  // A lease found gone with no sequence under it: once more, with a new one.
  if (!plan.ok() && IsLeaseExpired(plan.status())) {
    plan = PlanOnce(seq_ids, append_lens, q_rows, kv_keys_after, apply_sinks);
  }
  return plan;
}

absl::StatusOr<std::shared_ptr<const StepPlan>> KvManager::PlanOnce(
    absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens,
    absl::Span<const int32_t> q_rows, absl::Span<const int32_t> kv_keys_after,
    absl::Span<const uint8_t> apply_sinks) {
  // q_lens: the tokens appended here (Plan()'s name for them).
  if (page_size_ <= 0) {
    return absl::FailedPreconditionError(
        "the client has no server info (Connect with fetch_info = true)");
  }
  if (seq_ids.empty()) return absl::InvalidArgumentError("seq_ids is empty");
  if (seq_ids.size() != q_lens.size()) {
    return absl::InvalidArgumentError(absl::StrCat(seq_ids.size(), " seq_ids but ",
                                                   q_lens.size(), " q_lens"));
  }
  if (q_rows.size() != q_lens.size() ||
      (!kv_keys_after.empty() && kv_keys_after.size() != q_lens.size()) ||
      (!apply_sinks.empty() && apply_sinks.size() != q_lens.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        seq_ids.size(), " seq_ids but ", q_rows.size(), " q_rows, ", kv_keys_after.size(),
        " kv_keys_after and ", apply_sinks.size(), " apply_sinks"));
  }
  int64_t total_rows = 0;
  for (size_t b = 0; b < q_rows.size(); ++b) {
    if (q_rows[b] < q_lens[b]) {
      return absl::InvalidArgumentError(absl::StrCat("q_rows[", b, "]=", q_rows[b],
                                                     " is less than the tokens appended, ",
                                                     q_lens[b]));
    }
    if (!kv_keys_after.empty() && kv_keys_after[b] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("kv_keys_after[", b, "]=",
                                                     kv_keys_after[b], " is negative"));
    }
    total_rows += q_rows[b];
  }
  if (total_rows > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("the step has more than 2^31 - 1 query rows");
  }
  absl::flat_hash_set<int64_t> seen;
  std::vector<int64_t> lost;
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    if (!seen.insert(seq_ids[b]).second) {
      return absl::InvalidArgumentError(absl::StrCat("seq_ids has ", seq_ids[b], " twice"));
    }
    if (q_lens[b] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("q_lens[", b, "]=", q_lens[b],
                                                     " is negative"));
    }
    if (lost_.contains(seq_ids[b])) lost.push_back(seq_ids[b]);
  }
  if (!lost.empty()) return SequencesLostError(lost, kLeaseGone);
  if (absl::Status s = CheckWritten(seq_ids); !s.ok()) return s;
  if (absl::Status s = Prepare(); !s.ok()) return s;

  // Pages each sequence needs beyond those it holds.
  std::vector<int32_t> needs(seq_ids.size());
  int64_t total_need = 0, total_q = 0;
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    auto it = seqs_.find(seq_ids[b]);
    const int64_t length = it == seqs_.end() ? 0 : it->second.length;
    const int64_t held = it == seqs_.end() ? 0 : static_cast<int64_t>(it->second.pages.size());
    const int64_t new_length = length + q_lens[b];
    if (new_length > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat("q_lens[", b, "]: sequence ", seq_ids[b],
                                                     " would exceed 2^31 - 1 tokens"));
    }
    needs[b] = static_cast<int32_t>(
        std::max<int64_t>(0, (new_length + page_size_ - 1) / page_size_ - held));
    total_need += needs[b];
    total_q += q_lens[b];
  }
  if (total_need > std::numeric_limits<int32_t>::max() ||
      total_q > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("the step needs more than 2^31 - 1 pages or tokens");
  }
  std::vector<int32_t> new_pages;
  if (total_need > 0) {
    auto allocated = rpc()->AllocatePages(static_cast<int32_t>(total_need));
    if (!allocated.ok()) return Failed(allocated.status(), total_need);
    new_pages = *std::move(allocated);
  }

  // The layout, and each sequence's pages after the step; nothing changes yet.
  auto plan = std::make_shared<StepPlan>();
  plan->step = step_ + 1;
  plan->seq_ids.assign(seq_ids.begin(), seq_ids.end());
  plan->q_lens.assign(q_rows.begin(), q_rows.end());
  plan->append_lens.assign(q_lens.begin(), q_lens.end());
  plan->kv_keys_after.assign(kv_keys_after.begin(), kv_keys_after.end());
  plan->apply_sinks.assign(apply_sinks.begin(), apply_sinks.end());
  plan->qo_indptr = {0};
  plan->kv_indptr = {0};
  plan->append_slots.reserve(total_q);
  plan->positions.reserve(total_q);
  std::vector<std::vector<int32_t>> pages_after(seq_ids.size());
  size_t taken = 0;
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    auto it = seqs_.find(seq_ids[b]);
    std::vector<int32_t>& pages = pages_after[b];
    if (it != seqs_.end()) pages = it->second.pages;
    pages.insert(pages.end(), new_pages.begin() + taken, new_pages.begin() + taken + needs[b]);
    taken += needs[b];
    const int64_t start = it == seqs_.end() ? 0 : it->second.length;
    const int64_t length = start + q_lens[b];
    for (int64_t pos = start; pos < length; ++pos) {
      plan->positions.push_back(pos);
      plan->append_slots.push_back(int64_t{pages[pos / page_size_]} * page_size_ +
                                   pos % page_size_);
    }
    plan->kv_indices.insert(plan->kv_indices.end(), pages.begin(), pages.end());
    plan->qo_indptr.push_back(plan->qo_indptr.back() + q_rows[b]);
    plan->kv_indptr.push_back(static_cast<int32_t>(plan->kv_indices.size()));
    plan->kv_lens.push_back(static_cast<int32_t>(length));
    const int64_t num_pages = static_cast<int64_t>(pages.size());
    plan->kv_last_page_len.push_back(
        num_pages == 0 ? 0 : static_cast<int32_t>(length - (num_pages - 1) * page_size_));
  }

  // Register the layout once for every layer. A failure gives the new pages back.
  if (options_.server_plans) {
    PlanLayout layout;
    layout.qo_indptr = plan->qo_indptr;
    layout.kv_indptr = plan->kv_indptr;
    layout.kv_indices = plan->kv_indices;
    layout.kv_last_page_len = plan->kv_last_page_len;
    layout.append_slots = plan->append_slots;
    layout.kv_keys_after = plan->kv_keys_after;
    layout.apply_sinks = plan->apply_sinks;
    layout.options = options_.attention;
    layout.layer_options = options_.layer_attention;
    auto id = rpc()->CreatePlan(layout);
    if (id.ok()) {
      plan->plan_id = *id;
    } else if (id.status().code() == absl::StatusCode::kUnimplemented) {
      options_.server_plans = false;  // a server without plans: send the layout
    } else {
      const absl::Status failed = id.status();
      if (IsLeaseExpired(failed) || IsStaleIncarnation(failed)) return Failed(failed);
      if (keeper_ != nullptr && OutcomeUnknown(failed)) {
        // The plan may exist, pinning the new pages: the next call releases
        // it and frees them (the lease lists both).
        dirty_ = true;
      } else if (!new_pages.empty()) {
        // Without a lease, a plan that may exist pins the pages until the
        // server drops it: they wait in to_free_.
        FreeUnowned(new_pages).IgnoreError();
      }
      return failed;
    }
  }

  // Commit: nothing below fails.
  step_ = plan->step;
  live_steps_.insert(plan->step);
  ran_layers_[plan->step];
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    auto [at, started] = seqs_.try_emplace(seq_ids[b]);
    Sequence& s = at->second;
    if (started) s.started_step = plan->step;
    s.pages = std::move(pages_after[b]);
    s.length = plan->kv_lens[b];
    Retire(s.plan);
    s.plan = plan;
    s.unwritten.clear();
  }
  latest_ = plan;
  // A failed release stays queued for the next Plan() or Finish().
  absl::Status released = ReleaseStale();
  if (!released.ok() && IsLeaseExpired(released)) {
    // The plan just made went with the lease: report the loss now.
    return Failed(released);
  }
  return std::shared_ptr<const StepPlan>(plan);
}

absl::StatusOr<PrefillResult> KvManager::Run(int32_t layer, absl::Span<const uint16_t> q,
                                             absl::Span<const uint16_t> k_new,
                                             absl::Span<const uint16_t> v_new,
                                             const StepPlan* plan) {
  if (plan == nullptr) plan = latest_.get();
  if (plan == nullptr) return absl::FailedPreconditionError("Run before any Plan");
  if (live_steps_.contains(plan->step) && !IsLatestPlan(plan)) {
    // Its step number is live here, but the plan is another manager's.
    return absl::FailedPreconditionError(absl::StrCat(
        "the plan of step ", plan->step, " was made by another KvManager: run it there"));
  }
  if (!live_steps_.contains(plan->step)) {
    std::vector<int64_t> lost;
    for (int64_t id : plan->seq_ids) {
      if (lost_.contains(id)) lost.push_back(id);
    }
    if (!lost.empty()) return SequencesLostError(lost, kLeaseGone);
    return absl::FailedPreconditionError(
        absl::StrCat("the plan of step ", plan->step,
                     " is stale: a later Plan() or Finish() changed one of its sequences"));
  }
  // A layer the server does not have is refused here, before anything is
  // sent: the server's refusal would mark it unwritten, and a layer that can
  // never run would keep plan() refusing the sequences.
  const int32_t num_layers = client_->info().num_layers();
  if (layer < 0 || layer >= num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer=", layer, " is outside [0, ", num_layers,
                                                   ") (the server's num_layers)"));
  }
  PrefillArgs args;
  args.layer = layer;
  args.q = q;
  if (plan->plan_id != 0) {
    args.plan_id = plan->plan_id;  // the server has the layout and the options
  } else {
    args.qo_indptr = plan->qo_indptr;
    args.kv_indptr = plan->kv_indptr;
    args.kv_indices = plan->kv_indices;
    args.kv_last_page_len = plan->kv_last_page_len;
    args.append_slots = plan->append_slots;
    args.kv_keys_after = plan->kv_keys_after;
    args.apply_sinks = plan->apply_sinks;
    args.options = AttentionOf(layer);
  }
  args.sm_scale = options_.sm_scale;
  args.causal = options_.causal;
  args.lse_base_e = options_.lse_base_e;
  args.append_k = k_new;
  args.append_v = v_new;
  auto out = rpc()->Prefill(args);
  if (!out.ok() && IsLeaseExpired(out.status())) return Failed(out.status());
  if (out.ok()) {
    std::vector<int32_t>& ran = ran_layers_[plan->step];
    auto at = std::lower_bound(ran.begin(), ran.end(), layer);
    if (at == ran.end() || *at != layer) ran.insert(at, layer);
  }
  // The plan is live, so it is the latest plan of each of its sequences.
  for (size_t b = 0; b < plan->seq_ids.size(); ++b) {
    if (plan->append_lens[b] == 0) continue;  // nothing appended here
    auto seq = seqs_.find(plan->seq_ids[b]);
    if (seq == seqs_.end()) continue;
    std::vector<int32_t>& unwritten = seq->second.unwritten;
    auto at = std::lower_bound(unwritten.begin(), unwritten.end(), layer);
    const bool listed = at != unwritten.end() && *at == layer;
    if (out.ok() && listed) {
      unwritten.erase(at);
    } else if (!out.ok() && !listed) {
      // It may or may not have appended this layer's rows.
      unwritten.insert(at, layer);
    }
  }
  return out;
}

absl::Status KvManager::Undo(const std::shared_ptr<const StepPlan>& plan) {
  if (plan == nullptr) return absl::InvalidArgumentError("Undo of no plan");
  for (int64_t id : plan->seq_ids) {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || it->second.plan != plan) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Undo: step ", plan->step, " is not the latest plan of sequence ", id));
    }
  }
  std::vector<int32_t> freed;
  Retire(plan);
  for (size_t b = 0; b < plan->seq_ids.size(); ++b) {
    auto it = seqs_.find(plan->seq_ids[b]);
    Sequence& s = it->second;
    const int64_t old_length = s.length - plan->append_lens[b];
    const size_t keep = static_cast<size_t>((old_length + page_size_ - 1) / page_size_);
    freed.insert(freed.end(), s.pages.begin() + std::min(keep, s.pages.size()), s.pages.end());
    s.pages.resize(std::min(keep, s.pages.size()));
    s.length = old_length;
    s.plan = nullptr;
    s.unwritten.clear();
    // A sequence this plan started is forgotten; one that existed before
    // (even empty) stays.
    if (s.started_step == plan->step) seqs_.erase(it);
  }
  if (latest_ == plan) latest_.reset();
  return FreeUnowned(std::move(freed));
}

absl::Status KvManager::Finish(absl::Span<const int64_t> seq_ids) {
  absl::flat_hash_set<int64_t> seen;
  for (int64_t id : seq_ids) {
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("seq_ids has ", id, " twice"));
    }
    if (!Has(id)) return absl::NotFoundError(absl::StrCat("sequence ", id, " unknown"));
  }
  // From here on the sequences are gone, whatever the server answers.
  std::vector<int32_t> pages;
  const size_t unreleased_before = unreleased_.size();
  for (int64_t id : seq_ids) {
    if (lost_.erase(id)) continue;  // its pages went with the lease
    auto it = seqs_.find(id);
    pages.insert(pages.end(), it->second.pages.begin(), it->second.pages.end());
    // The plans of these sequences pin their pages: they are released first.
    Retire(it->second.plan);
    seqs_.erase(it);
  }
  if (latest_ != nullptr && !live_steps_.contains(latest_->step)) latest_.reset();
  // Nothing of these sequences to free (lost ones, or empty): no RPC; what
  // earlier calls left pending waits for the next call that allocates.
  if (pages.empty() && unreleased_.size() == unreleased_before) return absl::OkStatus();
  if (keeper_ != nullptr && keeper_->expired()) {
    std::vector<int64_t> lost = LoseAll();  // these sequences' pages went with it
    return lost.empty() ? absl::OkStatus() : SequencesLostError(lost, kLeaseGone);
  }
  absl::Status s = FreeUnowned(std::move(pages));
  if (s.ok() || s.code() == absl::StatusCode::kDataLoss) return s;
  if (IsLeaseExpired(s)) return absl::OkStatus();  // their pages went with it, no other lost
  if (IsStaleIncarnation(s)) {
    return Prefixed(s, "Finish: the sequences are forgotten (the server restarted: their pages "
                       "are gone): ");
  }
  return Prefixed(s, "Finish: the sequences are forgotten, but freeing their pages was not "
                     "confirmed; ");
}

absl::Status KvManager::Release() {
  // Finish() first: FreePages answers once the pages are zeroed and free.
  std::vector<int64_t> all = Sequences();
  for (int64_t id : lost_) all.push_back(id);
  absl::Status s = all.empty() ? FreeUnowned({}) : Finish(all);
  if (!options_.lease) return s;
  // Then the lease ends: revoking it releases whatever a failure left under it.
  ClearBookkeeping();
  if (keeper_ != nullptr) {
    unrevoked_.push_back(keeper_->id());
    EndLease();
  }
  absl::Status revoked = RevokeEnded();
  if (revoked.ok()) return absl::OkStatus();  // nothing is left held
  if (!s.ok()) return s;
  return Prefixed(revoked,
                  "Release: every sequence is forgotten, but revoking the manager's lease was not "
                  "confirmed; it is tried again at the next call, and the server frees everything "
                  "under the lease when it ends, within its ttl: ");
}

int64_t KvManager::KvLen(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? -1 : it->second.length;
}

bool KvManager::Has(int64_t seq_id) const {
  return seqs_.contains(seq_id) || lost_.contains(seq_id);
}

std::vector<int32_t> KvManager::PagesOf(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? std::vector<int32_t>() : it->second.pages;
}

int64_t KvManager::NumPages() const {
  int64_t n = 0;
  for (const auto& [id, s] : seqs_) n += static_cast<int64_t>(s.pages.size());
  return n;
}

std::vector<int64_t> KvManager::Sequences() const {
  std::vector<int64_t> ids;
  ids.reserve(seqs_.size());
  for (const auto& [id, s] : seqs_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<int64_t> KvManager::Lost() const {
  std::vector<int64_t> ids(lost_.begin(), lost_.end());
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace attnserve
