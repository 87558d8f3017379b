// Paged KV manager: plan a step once, run it for every layer.
//
// docs/kv_manager.md is the contract; attnserve.KvManager (client/python) is
// the Python twin with the same semantics.
//
//   auto client = Client::Connect({.target = "127.0.0.1:50051"});
//   KvManager mgr(client->get());
//   auto plan = mgr.Plan({7, 9}, {5, 3});       // 5 and 3 new tokens
//   for (int32_t layer = 0; layer < num_layers; ++layer) {
//     // q (8, qo_heads, head_dim); k, v (8, kv_heads, head_dim) of the new tokens
//     auto out = mgr.Run(layer, q, k, v);       // appends k, v, then attends
//   }
//   mgr.Finish({7});                            // frees sequence 7's pages
//
// Plan() grows each sequence by its q_len: it allocates the pages the step
// needs (one AllocatePages for the whole batch), advances the lengths (once
// per step, not per layer), lays the step out once and registers the layout
// with the server (CreatePlan). Run() sends one Prefill per layer that names
// the plan, with the fused append of that layer's new K/V rows.
//
// Not thread-safe: one thread plans, runs and finishes.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/client.h"

namespace attnserve {

struct KvManagerOptions {
  // Prefill options of every Run().
  bool causal = true;
  std::optional<float> sm_scale;  // default 1/sqrt(head_dim)
  bool lse_base_e = false;
  // Attention options (docs/design.md, "Variants") of every layer, but those
  // of the layers in layer_attention, which replace them for that layer (a
  // model whose windowed and full layers alternate). With server plans each
  // step's plan carries them; without, each layer's Prefill.
  AttentionOptions attention;
  std::map<int32_t, AttentionOptions> layer_attention;
  // Register each step's layout with CreatePlan; false sends it with every
  // layer instead (as for a server without plans, which also turns it off).
  bool server_plans = true;
};

// One step's layout. Shapes in brackets; batch = seq_ids.size().
struct StepPlan {
  int64_t step = 0;                       // 1, 2, ... per Plan() of a manager
  std::vector<int64_t> seq_ids;           // [batch], in batch order
  std::vector<int32_t> q_lens;            // [batch] query rows (Plan(): the new tokens)
  std::vector<int32_t> append_lens;       // [batch] new tokens (Plan(): q_lens)
  std::vector<int32_t> kv_lens;           // [batch] lengths after the append
  std::vector<int32_t> qo_indptr;         // [batch + 1]
  std::vector<int32_t> kv_indptr;         // [batch + 1]
  std::vector<int32_t> kv_indices;        // [kv_indptr[batch]] page ids
  std::vector<int32_t> kv_last_page_len;  // [batch], 0 for a sequence without pages
  std::vector<int32_t> kv_keys_after;     // [batch] or empty (PlanRows only)
  std::vector<uint8_t> apply_sinks;       // [batch] or empty: 0 where sinks stay out (PlanRows)
  std::vector<int64_t> append_slots;      // [num_append] where each new token's K/V goes
  std::vector<int64_t> positions;         // [num_append] each new token's position
  uint64_t plan_id = 0;                   // the server's plan; 0: the layout travels
  int64_t total_q() const { return qo_indptr.empty() ? 0 : qo_indptr.back(); }
};

class KvManager {
 public:
  // `client` must have read the server's info (Client::Connect does, unless
  // fetch_info is false) and outlive the manager.
  explicit KvManager(Client* client, KvManagerOptions options = {});

  // Grows seq_ids[b] by q_lens[b] tokens and lays the step out. A sequence
  // not seen before starts empty. On any error (bad arguments: INVALID_ARGUMENT
  // naming the field; no pages: RESOURCE_EXHAUSTED) nothing changes.
  absl::StatusOr<std::shared_ptr<const StepPlan>> Plan(absl::Span<const int64_t> seq_ids,
                                                       absl::Span<const int32_t> q_lens);

  // Plan() for one server of a cluster (client/cluster.h), where this
  // server holds a contiguous range of each sequence: seq_ids[b] grows by
  // append_lens[b] tokens here, but the step sends q_rows[b] >= append_lens[b]
  // query rows (the sequence's new tokens, some of which are appended on
  // other servers), and kv_keys_after[b] of the sequence's keys (after the
  // step) lie beyond this range (empty: 0). apply_sinks[b] 0: the attention
  // sinks stay out of sequence b here (another server's range carries them;
  // empty: all in). Run() then takes k_new, v_new of the appended rows only.
  // Atomic as Plan().
  absl::StatusOr<std::shared_ptr<const StepPlan>> PlanRows(
      absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> append_lens,
      absl::Span<const int32_t> q_rows, absl::Span<const int32_t> kv_keys_after,
      absl::Span<const uint8_t> apply_sinks = {});

  // Takes back `plan`, which must be the latest plan of each of its
  // sequences: their lengths go back, the pages it allocated are freed, its
  // server plan is released and it goes stale, as do the plans it had made
  // stale (their server plans are gone). Sequences it started are forgotten.
  // For a cluster whose step failed on another server.
  absl::Status Undo(const std::shared_ptr<const StepPlan>& plan);

  // One layer of a step: appends k_new, v_new (total_q, kv_heads, head_dim)
  // at the plan's slots, then attends with q (total_q, qo_heads, head_dim).
  // `plan` defaults to the latest; a plan whose sequences a later Plan() or
  // Finish() touched is stale (FAILED_PRECONDITION).
  absl::StatusOr<PrefillResult> Run(int32_t layer, absl::Span<const uint16_t> q,
                                    absl::Span<const uint16_t> k_new,
                                    absl::Span<const uint16_t> v_new,
                                    const StepPlan* plan = nullptr);

  // Releases the sequences' plans, frees their pages (one FreePages) and
  // forgets them. NOT_FOUND for an unknown id (and nothing freed).
  absl::Status Finish(absl::Span<const int64_t> seq_ids);
  // Finish() of every sequence.
  absl::Status Release();
  // Forgets every sequence and plan without an RPC (the server restarted;
  // then client->ForgetIncarnation() once the state is re-created).
  void Reset();

  // Length of a sequence; -1 when unknown.
  int64_t KvLen(int64_t seq_id) const;
  // Its pages, in order (empty when unknown).
  std::vector<int32_t> PagesOf(int64_t seq_id) const;
  // Pages this manager holds on the server.
  int64_t NumPages() const;
  std::vector<int64_t> Sequences() const;
  int32_t page_size() const { return page_size_; }
  // False once a server answered CreatePlan with UNIMPLEMENTED.
  bool server_plans() const { return options_.server_plans; }

 private:
  struct Sequence {
    std::vector<int32_t> pages;
    int64_t length = 0;
    std::shared_ptr<const StepPlan> plan;  // the latest plan that includes it
  };

  // The attention options of `layer`.
  const AttentionOptions& AttentionOf(int32_t layer) const;
  // Marks a sequence's plan stale; its server plan waits in unreleased_.
  void Retire(const std::shared_ptr<const StepPlan>& plan);
  // ReleasePlan of the stale server plans; NOT_FOUND counts as released.
  absl::Status ReleaseStale();

  Client* client_;
  KvManagerOptions options_;
  int32_t page_size_;
  int64_t step_ = 0;
  absl::flat_hash_map<int64_t, Sequence> seqs_;
  std::shared_ptr<const StepPlan> latest_;
  absl::flat_hash_set<int64_t> live_steps_;  // plans no later plan or Finish touched
  std::vector<uint64_t> unreleased_;
};

}  // namespace attnserve
