#include "client/kv_manager.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

KvManager::KvManager(Client* client, KvManagerOptions options)
    : client_(client), options_(options), page_size_(client->info().page_size()) {}

void KvManager::Retire(const std::shared_ptr<const StepPlan>& plan) {
  if (plan == nullptr || !live_steps_.erase(plan->step)) return;
  if (plan->plan_id != 0) unreleased_.push_back(plan->plan_id);
}

absl::Status KvManager::ReleaseStale() {
  while (!unreleased_.empty()) {
    absl::Status s = client_->ReleasePlan(unreleased_.back());
    // NOT_FOUND: the server dropped it already (idle timeout or restart).
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) return s;
    unreleased_.pop_back();
  }
  return absl::OkStatus();
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
  // Pages each sequence needs beyond those it holds.
  absl::flat_hash_set<int64_t> seen;
  std::vector<int32_t> needs(seq_ids.size());
  int64_t total_need = 0, total_q = 0;
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    if (!seen.insert(seq_ids[b]).second) {
      return absl::InvalidArgumentError(absl::StrCat("seq_ids has ", seq_ids[b], " twice"));
    }
    if (q_lens[b] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("q_lens[", b, "]=", q_lens[b],
                                                     " is negative"));
    }
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
    auto allocated = client_->AllocatePages(static_cast<int32_t>(total_need));
    if (!allocated.ok()) return allocated.status();
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
    auto id = client_->CreatePlan(layout);
    if (id.ok()) {
      plan->plan_id = *id;
    } else if (id.status().code() == absl::StatusCode::kUnimplemented) {
      options_.server_plans = false;  // a server without plans: send the layout
    } else {
      if (!new_pages.empty()) client_->FreePages(new_pages).IgnoreError();
      return id.status();
    }
  }

  // Commit: nothing below fails.
  step_ = plan->step;
  live_steps_.insert(plan->step);
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    Sequence& s = seqs_[seq_ids[b]];
    s.pages = std::move(pages_after[b]);
    s.length = plan->kv_lens[b];
    Retire(s.plan);
    s.plan = plan;
  }
  latest_ = plan;
  // A failed release stays queued for the next Plan() or Finish().
  ReleaseStale().IgnoreError();
  return std::shared_ptr<const StepPlan>(plan);
}

absl::StatusOr<PrefillResult> KvManager::Run(int32_t layer, absl::Span<const uint16_t> q,
                                             absl::Span<const uint16_t> k_new,
                                             absl::Span<const uint16_t> v_new,
                                             const StepPlan* plan) {
  if (plan == nullptr) plan = latest_.get();
  if (plan == nullptr) return absl::FailedPreconditionError("Run before any Plan");
  if (!live_steps_.contains(plan->step)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the plan of step ", plan->step,
                     " is stale: a later Plan() or Finish() changed one of its sequences"));
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
  return client_->Prefill(args);
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
    if (old_length == 0 && s.pages.empty()) seqs_.erase(it);
  }
  if (latest_ == plan) latest_.reset();
  absl::Status released = ReleaseStale();
  if (!freed.empty()) {
    if (absl::Status s = client_->FreePages(freed); !s.ok()) return s;
  }
  return released;
}

absl::Status KvManager::Finish(absl::Span<const int64_t> seq_ids) {
  std::vector<int32_t> pages;
  absl::flat_hash_set<int64_t> seen;
  for (int64_t id : seq_ids) {
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("seq_ids has ", id, " twice"));
    }
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", id, " unknown"));
    pages.insert(pages.end(), it->second.pages.begin(), it->second.pages.end());
  }
  // The plans of these sequences pin their pages: release them first.
  for (int64_t id : seq_ids) Retire(seqs_[id].plan);
  if (absl::Status s = ReleaseStale(); !s.ok()) return s;
  if (!pages.empty()) {
    if (absl::Status s = client_->FreePages(pages); !s.ok()) return s;
  }
  for (int64_t id : seq_ids) seqs_.erase(id);
  return absl::OkStatus();
}

absl::Status KvManager::Release() {
  if (seqs_.empty()) return ReleaseStale();
  return Finish(Sequences());
}

void KvManager::Reset() {
  seqs_.clear();
  live_steps_.clear();
  unreleased_.clear();
  latest_.reset();
}

int64_t KvManager::KvLen(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? -1 : it->second.length;
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

}  // namespace attnserve
