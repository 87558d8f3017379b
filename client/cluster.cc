// The cluster's steps (client/cluster.h): Plan places each sequence's new
// tokens and makes every server's share of the step, Run sends a layer's
// rows to each server and merges the answers by LSE, Finish releases
// sequences. The servers themselves are client/cluster_servers.cc's.
#include "client/cluster.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cluster_placement.h"
#include "kernels/merge_states.h"

#define ATTN_CLUSTER_RETURN_IF_ERROR(expr)     \
  do {                                         \
    absl::Status _st = (expr);                 \
    if (!_st.ok()) return _st;                 \
  } while (0)

namespace attnserve {
namespace {

// The arguments of Plan(), before anything is read or changed.
absl::Status CheckStepArgs(absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens) {
  if (seq_ids.empty()) return absl::InvalidArgumentError("seq_ids is empty");
  if (seq_ids.size() != q_lens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(seq_ids.size(), " seq_ids but ", q_lens.size(), " q_lens"));
  }
  absl::flat_hash_set<int64_t> seen;
  int64_t total_q = 0;
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    if (!seen.insert(seq_ids[b]).second) {
      return absl::InvalidArgumentError(absl::StrCat("seq_ids has ", seq_ids[b], " twice"));
    }
    if (q_lens[b] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("q_lens[", b, "]=", q_lens[b], " is negative"));
    }
    total_q += q_lens[b];
  }
  if (total_q > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError("the step has more than 2^31 - 1 tokens");
  }
  return absl::OkStatus();
}

// The step in the caller's terms, and each part's rows (step->parts planned,
// in server order, one for each server with a share).
void FillStep(absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens,
              const StepShares& shares, ClusterStep* step) {
  step->seq_ids.assign(seq_ids.begin(), seq_ids.end());
  step->q_lens.assign(q_lens.begin(), q_lens.end());
  step->qo_indptr = {0};
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    const int64_t length = shares.length_after[b];
    step->kv_lens.push_back(length);
    step->qo_indptr.push_back(step->qo_indptr.back() + q_lens[b]);
    for (int64_t p = length - q_lens[b]; p < length; ++p) step->positions.push_back(p);
  }
  step->sources.resize(seq_ids.size());
  for (size_t pi = 0; pi < step->parts.size(); ++pi) {
    ClusterStep::Part& part = step->parts[pi];
    const std::vector<ShareEntry>& entries = shares.per_server[part.server];
    for (size_t j = 0; j < entries.size(); ++j) {
      const ShareEntry& e = entries[j];
      const int32_t first = step->qo_indptr[e.b];
      step->sources[e.b].push_back({static_cast<int32_t>(pi), part.plan->qo_indptr[j], e.skip});
      for (int32_t r = e.skip; r < q_lens[e.b]; ++r) part.q_rows.push_back(first + r);
      for (int32_t r = 0; r < e.append; ++r) {
        part.append_rows.push_back(first + static_cast<int32_t>(e.offset) + r);
      }
    }
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<const ClusterStep>> Cluster::Plan(
    absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens) {
  bool again = false;
  auto step = PlanOnce(seq_ids, q_lens, &again);
  // A server found restarted (or its lease gone) that held none of these
  // sequences: it starts afresh, and the plan can go there now.
  if (again) step = PlanOnce(seq_ids, q_lens, &again);
  return step;
}

absl::StatusOr<std::shared_ptr<const ClusterStep>> Cluster::PlanOnce(
    absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens, bool* again) {
  *again = false;
  ATTN_CLUSTER_RETURN_IF_ERROR(CheckStepArgs(seq_ids, q_lens));
  // Now and then: new servers join, free pages and restarts are read (the
  // sequences a restart lost are reported when they are named).
  // Also when no server takes new sequences: one that failed a call may answer now.
  const bool none_usable = std::none_of(servers_.begin(), servers_.end(),
                                        [](const auto& s) { return Usable(*s); });
  if (none_usable || absl::Now() - refreshed_at_ >= absl::Seconds(options_.refresh_interval_s)) {
    Refresh().IgnoreError();
  }
  std::vector<int64_t> lost;
  for (int64_t id : seq_ids) {
    auto it = seqs_.find(id);
    if (it != seqs_.end() && it->second.lost) lost.push_back(id);
  }
  if (!lost.empty()) return LostError(lost, "a server holding them restarted or left");
  ATTN_CLUSTER_RETURN_IF_ERROR(CheckWritten(seq_ids));

  // The sequences as they are, and each server's free pages.
  std::vector<std::vector<Shard>> shards(seq_ids.size());
  std::vector<int64_t> lengths(seq_ids.size(), 0);
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    auto it = seqs_.find(seq_ids[b]);
    if (it == seqs_.end()) continue;
    shards[b] = it->second.shards;
    lengths[b] = it->second.length;
  }
  std::vector<int64_t> free(servers_.size());
  for (size_t i = 0; i < servers_.size(); ++i) {
    free[i] = Usable(*servers_[i]) ? FreeEstimate(*servers_[i]) : -1;
  }
  PlacementRules rules;
  rules.page_size = geo_.page_size;
  rules.split_min_tokens = options_.split_min_tokens;
  rules.max_servers_per_sequence = options_.max_servers_per_sequence;
  auto chunks = PlaceTokens(seq_ids, q_lens, shards, rules, &free);
  if (!chunks.ok()) return chunks.status();
  StepShares shares = ShareStep(q_lens, shards, lengths, *chunks, num_servers(), options_.kv.causal);

  auto step = std::make_shared<ClusterStep>();
  ATTN_CLUSTER_RETURN_IF_ERROR(PlanParts(seq_ids, q_lens, shares, step.get(), again));
  step->step = ++step_;
  FillStep(seq_ids, q_lens, shares, step.get());

  // Commit.
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    Sequence& s = seqs_[seq_ids[b]];
    s.shards = std::move(shares.shards_after[b]);
    s.length = shares.length_after[b];
    if (s.step != nullptr) live_steps_.erase(s.step->step);
    s.step = step;
  }
  live_steps_.insert(step->step);
  latest_ = step;
  return std::shared_ptr<const ClusterStep>(step);
}

absl::Status Cluster::CheckWritten(absl::Span<const int64_t> seq_ids) {
  // A layer that failed on one server holds up every sequence of its step,
  // as a KvManager's failed Run() holds up its whole plan: planning any of
  // them would make the step stale, and the layer could not run again.
  std::vector<int64_t> ids(seq_ids.begin(), seq_ids.end());
  absl::flat_hash_set<int64_t> listed(seq_ids.begin(), seq_ids.end());
  for (int64_t id : seq_ids) {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || it->second.step == nullptr || !live_steps_.contains(it->second.step->step)) {
      continue;
    }
    for (int64_t other : it->second.step->seq_ids) {
      if (listed.insert(other).second) ids.push_back(other);
    }
  }
  for (int32_t srv = 0; srv < num_servers(); ++srv) {
    std::vector<int64_t> here;
    for (int64_t id : ids) {
      auto it = seqs_.find(id);
      if (it == seqs_.end()) continue;
      for (const Shard& sh : it->second.shards) {
        if (sh.server == srv) here.push_back(id);
      }
    }
    if (here.empty()) continue;
    absl::Status written = servers_[srv]->kv->CheckWritten(here);
    if (!written.ok()) {
      return absl::Status(written.code(), absl::StrCat("server ", servers_[srv]->address, ": ",
                                                       written.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Cluster::PlanParts(absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens,
                                const StepShares& shares, ClusterStep* step, bool* again) {
  std::vector<std::pair<int32_t, std::shared_ptr<const StepPlan>>> done;
  absl::Status failed;
  int32_t failed_server = -1;
  for (int32_t srv = 0; srv < num_servers(); ++srv) {
    const std::vector<ShareEntry>& entries = shares.per_server[srv];
    if (entries.empty()) continue;
    std::vector<int64_t> ids;
    std::vector<int32_t> appends, rows, after;
    // The sinks enter a sequence's softmax on one server only, so that the
    // merge by LSE counts them once: the one holding its first keys.
    std::vector<uint8_t> sinks;
    for (const ShareEntry& e : entries) {
      ids.push_back(seq_ids[e.b]);
      appends.push_back(e.append);
      rows.push_back(q_lens[e.b] - e.skip);
      after.push_back(static_cast<int32_t>(shares.length_after[e.b] - e.end));
      sinks.push_back(e.first ? 1 : 0);
    }
    auto planned = servers_[srv]->kv->PlanRows(ids, appends, rows, after, sinks);
    if (!planned.ok()) {
      failed = planned.status();
      failed_server = srv;
      break;
    }
    done.push_back({srv, *planned});
    ClusterStep::Part part;
    part.server = srv;
    part.epoch = servers_[srv]->epoch;
    part.plan = *planned;
    step->parts.push_back(std::move(part));
  }
  if (failed.ok()) {
    for (const auto& [srv, plan] : done) Observe(srv, absl::OkStatus(), nullptr);
    return absl::OkStatus();
  }
  // A failure takes back the plans before it.
  std::vector<int64_t> l;
  for (auto it = done.rbegin(); it != done.rend(); ++it) {
    // Undo takes the bookkeeping back whatever happens; a free it could
    // not confirm is its manager's to settle. A loss is the cluster's.
    absl::Status undone = servers_[it->first]->kv->Undo(it->second);
    if (undone.code() == absl::StatusCode::kDataLoss || IsStaleIncarnation(undone)) {
      Observe(it->first, undone, &l);
    }
    // The server's previous plan of these sequences went stale when this
    // one was made, and undo does not bring it back: the cluster steps that
    // ran them there cannot run again (they would fail on that server, and
    // another server's parts of them could still be in flight).
    for (int64_t id : it->second->seq_ids) {
      auto seq = seqs_.find(id);
      if (seq != seqs_.end() && seq->second.step != nullptr) {
        live_steps_.erase(seq->second.step->step);
      }
    }
  }
  const std::string address = servers_[failed_server]->address;
  if (failed.code() == absl::StatusCode::kResourceExhausted) {
    // Its free pages were fewer than the estimate (others took them, or a
    // failed free left some held): read them again for the next placement.
    auto info = servers_[failed_server]->client->GetServerInfo();
    if (info.ok()) ReadInfo(failed_server, *info);
  }
  const bool accounted = Observe(failed_server, failed, &l);
  // Lost sequences of the step fail it; others lost now are reported when a
  // call names them, and the step can be planned again at once.
  const absl::flat_hash_set<int64_t> wanted(seq_ids.begin(), seq_ids.end());
  std::vector<int64_t> named;
  for (int64_t id : l) {
    if (wanted.contains(id)) named.push_back(id);
  }
  if (!named.empty()) {
    return LostError(named, accounted ? absl::StrCat("server ", address, ": ", failed.message())
                                      : "a server holding them restarted or lost their pages");
  }
  if (accounted) *again = !Unreachable(failed);
  return absl::Status(failed.code(), absl::StrCat("server ", address, ": ", failed.message()));
}

absl::StatusOr<PrefillResult> Cluster::Run(int32_t layer, absl::Span<const uint16_t> q,
                                           absl::Span<const uint16_t> k_new,
                                           absl::Span<const uint16_t> v_new,
                                           const ClusterStep* step, PrefillResult* partial) {
  if (step == nullptr) step = latest_.get();
  if (step == nullptr) return absl::FailedPreconditionError("Run before any Plan");
  if (!live_steps_.contains(step->step)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the step ", step->step,
                     " is stale: a later Plan() or Finish() changed one of its sequences"));
  }
  // Its number is live here; the step itself must be this cluster's (another
  // cluster's names other servers).
  auto first = step->seq_ids.empty() ? seqs_.end() : seqs_.find(step->seq_ids[0]);
  if (first == seqs_.end() || first->second.step.get() != step) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the step ", step->step, " was planned by another Cluster: run it there"));
  }
  const int64_t q_row = geo_.QRowElems();
  const int64_t o_row = geo_.ORowElems();  // MLA: kv_lora_rank wide
  const int64_t kv_row = geo_.RowElems();
  const int64_t v_row = geo_.HasVPool() ? kv_row : 0;  // MLA: no V rows
  const int64_t total_q = step->total_q();
  if (static_cast<int64_t>(q.size()) != total_q * q_row) {
    return absl::InvalidArgumentError(absl::StrCat("q has ", q.size(), " values, the step needs ",
                                                   total_q, " x ", geo_.num_qo_heads, " x ",
                                                   geo_.head_dim));
  }
  if (static_cast<int64_t>(k_new.size()) != total_q * kv_row ||
      static_cast<int64_t>(v_new.size()) != total_q * v_row) {
    return absl::InvalidArgumentError(absl::StrCat(
        "k_new and v_new have ", k_new.size(), " and ", v_new.size(), " values, the step needs ",
        total_q, " x ", geo_.num_kv_heads, " x ", geo_.head_dim, " each",
        geo_.HasVPool() ? "" : " in k_new and none in v_new (an MLA server's latent rows)"));
  }

  // One Prefill per server, all in flight at once.
  const size_t num_parts = step->parts.size();
  std::vector<absl::StatusOr<PrefillResult>> results(num_parts,
                                                     absl::UnknownError("not run"));
  std::vector<bool> skipped(num_parts, false);
  auto run_part = [&](size_t pi) {
    const ClusterStep::Part& part = step->parts[pi];
    std::vector<uint16_t> q_sub(part.q_rows.size() * q_row);
    for (size_t r = 0; r < part.q_rows.size(); ++r) {
      std::copy_n(q.begin() + part.q_rows[r] * q_row, q_row, q_sub.begin() + r * q_row);
    }
    std::vector<uint16_t> k_sub(part.append_rows.size() * kv_row);
    std::vector<uint16_t> v_sub(part.append_rows.size() * v_row);
    for (size_t r = 0; r < part.append_rows.size(); ++r) {
      std::copy_n(k_new.begin() + part.append_rows[r] * kv_row, kv_row,
                  k_sub.begin() + r * kv_row);
      std::copy_n(v_new.begin() + part.append_rows[r] * v_row, v_row,
                  v_sub.begin() + r * v_row);
    }
    results[pi] = servers_[part.server]->kv->Run(layer, q_sub, k_sub, v_sub, part.plan.get());
  };
  std::vector<std::thread> threads;
  std::vector<size_t> to_run;
  for (size_t pi = 0; pi < num_parts; ++pi) {
    const ClusterStep::Part& part = step->parts[pi];
    // A server that restarted since the plan holds nothing of it any more.
    if (servers_[part.server]->epoch != part.epoch) {
      skipped[pi] = true;
    } else {
      to_run.push_back(pi);
    }
  }
  for (size_t j = 1; j < to_run.size(); ++j) threads.emplace_back(run_part, to_run[j]);
  if (!to_run.empty()) run_part(to_run[0]);
  for (std::thread& t : threads) t.join();

  // Restarts, lost leases and servers unreachable for too long lose their
  // sequences (their rows come back empty, with DATA_LOSS); any other
  // failure is the answer.
  absl::Status failure;
  std::vector<int64_t> found_lost;
  for (size_t pi : to_run) {
    const int32_t srv = step->parts[pi].server;
    if (Observe(srv, results[pi].status(), &found_lost)) {
      skipped[pi] = true;
    } else if (!results[pi].ok() && failure.ok()) {
      failure = absl::Status(results[pi].status().code(),
                             absl::StrCat("server ", servers_[srv]->address, ": ",
                                          results[pi].status().message()));
    }
  }
  if (!failure.ok()) return failure;

  // Assemble in the caller's order: copy, or merge the servers' states.
  PrefillResult out;
  out.o.assign(total_q * o_row, 0);
  out.lse.assign(total_q * geo_.num_qo_heads, -std::numeric_limits<float>::infinity());
  std::vector<int64_t> lost;
  const int32_t hq = geo_.num_qo_heads;
  for (size_t b = 0; b < step->seq_ids.size(); ++b) {
    const auto& sources = step->sources[b];
    const bool whole = std::none_of(sources.begin(), sources.end(),
                                    [&](const auto& src) { return skipped[src.part]; });
    if (!whole) {
      lost.push_back(step->seq_ids[b]);
      continue;
    }
    const int64_t n = step->q_lens[b];
    const int64_t row0 = step->qo_indptr[b];
    if (n == 0) continue;
    // Rows [lo, hi) between two servers' first rows have the same servers:
    // copy from one, or merge.
    std::vector<int64_t> cuts = {n};
    for (const auto& src : sources) cuts.push_back(src.skip);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      const int64_t lo = cuts[c], hi = cuts[c + 1];
      std::vector<const void*> vs;
      std::vector<const float*> lses;
      for (const auto& src : sources) {
        if (src.skip > lo) continue;
        const PrefillResult& r = *results[src.part];
        const int64_t at = src.row + (lo - src.skip);  // row lo of the sequence
        vs.push_back(r.o.data() + at * o_row);
        lses.push_back(r.lse.data() + at * hq);
      }
      if (vs.empty()) continue;  // no causal row is without its own key: not reached
      uint16_t* o_at = out.o.data() + (row0 + lo) * o_row;
      float* lse_at = out.lse.data() + (row0 + lo) * hq;
      if (vs.size() == 1) {
        std::copy_n(static_cast<const uint16_t*>(vs[0]), (hi - lo) * o_row, o_at);
        std::copy_n(lses[0], (hi - lo) * hq, lse_at);
        continue;
      }
      MergeStatesParams m;
      m.v = vs.data();
      m.lse = lses.data();
      m.num_states = static_cast<int32_t>(vs.size());
      m.v_out = o_at;
      m.lse_out = lse_at;
      m.n = hi - lo;
      m.h = hq;
      m.d = geo_.VDim();
      m.dtype = geo_.dtype;
      m.lse_base_e = options_.kv.lse_base_e ? 1 : 0;
      MergeStatesCpu(m);
    }
  }
  for (size_t pi : to_run) {
    if (results[pi].ok()) out.incarnation = results[pi]->incarnation;
  }
  if (!lost.empty()) {
    if (partial != nullptr) *partial = std::move(out);
    return LostError(lost, "a server holding them restarted, lost their pages or could not be "
                           "reached");
  }
  return out;
}

absl::Status Cluster::Finish(absl::Span<const int64_t> seq_ids) {
  absl::flat_hash_set<int64_t> seen;
  for (int64_t id : seq_ids) {
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("seq_ids has ", id, " twice"));
    }
    if (!seqs_.contains(id)) return absl::NotFoundError(absl::StrCat("sequence ", id, " unknown"));
  }
  std::vector<std::vector<int64_t>> per_server(servers_.size());
  for (int64_t id : seq_ids) {
    for (const Shard& sh : seqs_[id].shards) {
      // A manager that forgot it (lost with its lease, reset) holds nothing of it.
      if (servers_[sh.server]->kv->Has(id)) per_server[sh.server].push_back(id);
    }
  }
  // Every named sequence goes, whatever the servers answer: a server that
  // fails is reported, and its KvManager (which forgot the sequences too)
  // frees their pages later.
  for (int64_t id : seq_ids) {
    auto it = seqs_.find(id);
    if (it->second.step != nullptr) live_steps_.erase(it->second.step->step);
    seqs_.erase(it);
  }
  std::vector<std::string> unconfirmed;
  absl::StatusCode code = absl::StatusCode::kOk;
  std::vector<int64_t> lost;
  for (int32_t srv = 0; srv < num_servers(); ++srv) {
    if (per_server[srv].empty()) continue;
    absl::Status s = servers_[srv]->kv->Finish(per_server[srv]);
    // A restart, a lost lease, or an unreachability declared a loss: the
    // pages are gone (or freed when the lease ends), nothing to report.
    if (Observe(srv, s, &lost) || s.ok()) continue;
    if (code == absl::StatusCode::kOk) code = s.code();
    unconfirmed.push_back(absl::StrCat("server ", servers_[srv]->address, " (sequences ",
                                       absl::StrJoin(per_server[srv], ", "), "): ", s.message()));
  }
  if (!unconfirmed.empty()) {
    return absl::Status(
        code, absl::StrCat("Finish: sequences ", absl::StrJoin(seq_ids, ", "),
                           " are finished (forgotten by the cluster), but freeing their pages "
                           "was not confirmed on ",
                           absl::StrJoin(unconfirmed, "; ")));
  }
  // Sequences outside seq_ids that a loss found now: say so.
  std::vector<int64_t> others;
  for (int64_t id : lost) {
    if (!seen.contains(id)) others.push_back(id);
  }
  if (!others.empty()) {
    return LostError(others, "a server holding them restarted, lost their pages or could not be "
                             "reached");
  }
  return absl::OkStatus();
}

absl::Status Cluster::Release() {
  std::vector<int64_t> ids;
  for (const auto& [id, s] : seqs_) ids.push_back(id);
  absl::Status finished = ids.empty() ? absl::OkStatus() : Finish(ids);
  // End every manager's lease: what a failed free left behind goes now (or
  // when the lease ends).
  for (const auto& s : servers_) {
    if (!s->gone) s->kv->Release().IgnoreError();
  }
  return finished;
}

int64_t Cluster::KvLen(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? -1 : it->second.length;
}

std::vector<Shard> Cluster::ShardsOf(int64_t seq_id) const {
  auto it = seqs_.find(seq_id);
  return it == seqs_.end() ? std::vector<Shard>() : it->second.shards;
}

std::vector<int64_t> Cluster::Sequences() const {
  std::vector<int64_t> ids;
  for (const auto& [id, s] : seqs_) {
    if (!s.lost) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<int64_t> Cluster::Lost() const {
  std::vector<int64_t> ids;
  for (const auto& [id, s] : seqs_) {
    if (s.lost) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace attnserve
