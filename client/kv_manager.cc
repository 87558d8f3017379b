#include "client/kv_manager.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace attnserve {

KvManager::KvManager(Client* client, KvManagerOptions options)
    : client_(client),
      options_(options),
      page_size_(client->info().page_size()),
      incarnation_(client->info().incarnation()) {}

absl::Status KvManager::CheckIncarnation(uint64_t incarnation) const {
  // A server that does not check expected_incarnation on an RPC still
  // reports its own: a different one means it restarted.
  if (incarnation == 0 || incarnation_ == 0 || incarnation == incarnation_) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("the server's incarnation is ", incarnation, ", this manager expected ",
                   incarnation_, ": the server restarted and its KV cache is gone"));
}

absl::StatusOr<std::vector<int32_t>> KvManager::AllocatePages(int32_t count) {
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  v1::AllocatePagesRequest req;
  req.set_count(count);
  req.set_expected_incarnation(incarnation_);
  v1::AllocatePagesResponse resp;
  grpc::Status s = client_->stub()->AllocatePages(&ctx, req, &resp);
  if (!s.ok()) return Client::FromGrpc(s);
  if (absl::Status st = CheckIncarnation(resp.incarnation()); !st.ok()) return st;
  if (resp.page_ids_size() != count) {
    return absl::InternalError(
        absl::StrCat("AllocatePages returned ", resp.page_ids_size(), " pages, asked ", count));
  }
  return std::vector<int32_t>(resp.page_ids().begin(), resp.page_ids().end());
}

absl::Status KvManager::FreePages(absl::Span<const int32_t> pages) {
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  v1::FreePagesRequest req;
  req.mutable_page_ids()->Assign(pages.begin(), pages.end());
  req.set_expected_incarnation(incarnation_);
  v1::FreePagesResponse resp;
  grpc::Status s = client_->stub()->FreePages(&ctx, req, &resp);
  if (!s.ok()) return Client::FromGrpc(s);
  return CheckIncarnation(resp.incarnation());
}

absl::StatusOr<std::shared_ptr<const StepPlan>> KvManager::Plan(
    absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens) {
  if (page_size_ <= 0) {
    return absl::FailedPreconditionError(
        "the client has no server info (Connect with fetch_info = true)");
  }
  if (seq_ids.empty()) return absl::InvalidArgumentError("seq_ids is empty");
  if (seq_ids.size() != q_lens.size()) {
    return absl::InvalidArgumentError(absl::StrCat(seq_ids.size(), " seq_ids but ",
                                                   q_lens.size(), " q_lens"));
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
    auto allocated = AllocatePages(static_cast<int32_t>(total_need));
    if (!allocated.ok()) return allocated.status();
    new_pages = *std::move(allocated);
  }

  // Commit: nothing below fails.
  auto plan = std::make_shared<StepPlan>();
  plan->step = ++step_;
  plan->seq_ids.assign(seq_ids.begin(), seq_ids.end());
  plan->q_lens.assign(q_lens.begin(), q_lens.end());
  plan->qo_indptr = {0};
  plan->kv_indptr = {0};
  plan->append_slots.reserve(total_q);
  plan->positions.reserve(total_q);
  size_t taken = 0;
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    Sequence& s = seqs_[seq_ids[b]];
    s.pages.insert(s.pages.end(), new_pages.begin() + taken,
                   new_pages.begin() + taken + needs[b]);
    taken += needs[b];
    const int64_t start = s.length;
    s.length += q_lens[b];
    s.plan_step = plan->step;
    for (int64_t pos = start; pos < s.length; ++pos) {
      plan->positions.push_back(pos);
      plan->append_slots.push_back(int64_t{s.pages[pos / page_size_]} * page_size_ +
                                   pos % page_size_);
    }
    plan->kv_indices.insert(plan->kv_indices.end(), s.pages.begin(), s.pages.end());
    plan->qo_indptr.push_back(plan->qo_indptr.back() + q_lens[b]);
    plan->kv_indptr.push_back(static_cast<int32_t>(plan->kv_indices.size()));
    plan->kv_lens.push_back(static_cast<int32_t>(s.length));
    const int64_t num_pages = static_cast<int64_t>(s.pages.size());
    plan->kv_last_page_len.push_back(
        num_pages == 0 ? 0 : static_cast<int32_t>(s.length - (num_pages - 1) * page_size_));
  }
  latest_ = plan;
  return std::shared_ptr<const StepPlan>(plan);
}

absl::StatusOr<PrefillResult> KvManager::Run(int32_t layer, absl::Span<const uint16_t> q,
                                             absl::Span<const uint16_t> k_new,
                                             absl::Span<const uint16_t> v_new,
                                             const StepPlan* plan) {
  if (plan == nullptr) plan = latest_.get();
  if (plan == nullptr) return absl::FailedPreconditionError("Run before any Plan");
  for (int64_t id : plan->seq_ids) {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || it->second.plan_step != plan->step) {
      return absl::FailedPreconditionError(
          absl::StrCat("the plan of step ", plan->step, " is stale: sequence ", id,
                       it == seqs_.end() ? " was finished" : " was planned again"));
    }
  }
  // Today every layer sends the layout; a server-side plan RPC would register
  // it once in Plan() and name it here instead.
  PrefillArgs args;
  args.layer = layer;
  args.q = q;
  args.qo_indptr = plan->qo_indptr;
  args.kv_indptr = plan->kv_indptr;
  args.kv_indices = plan->kv_indices;
  args.kv_last_page_len = plan->kv_last_page_len;
  args.sm_scale = options_.sm_scale;
  args.causal = options_.causal;
  args.lse_base_e = options_.lse_base_e;
  args.append_slots = plan->append_slots;
  args.append_k = k_new;
  args.append_v = v_new;
  args.expected_incarnation = incarnation_;
  auto result = client_->Prefill(args);
  if (!result.ok()) return result.status();
  if (absl::Status st = CheckIncarnation(result->incarnation); !st.ok()) return st;
  return result;
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
  if (!pages.empty()) {
    if (absl::Status s = FreePages(pages); !s.ok()) return s;
  }
  for (int64_t id : seq_ids) seqs_.erase(id);
  return absl::OkStatus();
}

absl::Status KvManager::Release() { return Finish(Sequences()); }

void KvManager::Reset() {
  seqs_.clear();
  latest_.reset();
  incarnation_ = client_->info().incarnation();
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
