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
// Leases (the default): the manager holds its pages and plans under a lease
// of its own (a Fork() of the client and a LeaseKeeper, granted at the first
// Plan()). If the process dies, the server frees them within the lease's
// ttl; destroying the manager, or Release(), revokes the lease. A failed call
// never leaves a sequence usable whose pages may have been freed: Finish()
// forgets its sequences whatever happens, and pages whose fate a failed call
// left unknown are reconciled against the server's list of the lease's
// holdings (ListHoldings) before the next Plan(), Finish() or Release().
// A lease that expired loses every sequence of the manager (DATA_LOSS naming
// them, LostSequences()). docs/kv_manager.md, "When a call fails".
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
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/lease.h"

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
  // Hold the pages and plans under a lease of the manager's own (as for a
  // server without leases, which also turns it off). false: the client's
  // requests as they are (its own lease, if any), as before leases; pages
  // whose fate a failed call left unknown are then leaked (Leaked()), never
  // freed or reused.
  bool lease = true;
  // The lease's time-to-live in ms (0: the server's --lease_default_ttl_s).
  int64_t lease_ttl_ms = 0;
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

// DATA_LOSS naming sequences whose KV is gone (`why` says how), with their
// ids as a payload that LostSequences() reads back.
absl::Status SequencesLostError(absl::Span<const int64_t> seq_ids, absl::string_view why);
// The sequences a DATA_LOSS status of KvManager or Cluster names (empty for
// any other).
std::vector<int64_t> LostSequences(const absl::Status& status);

class KvManager {
 public:
  // `client` must have read the server's info (Client::Connect does, unless
  // fetch_info is false) and outlive the manager.
  explicit KvManager(Client* client, KvManagerOptions options = {});
  // Revokes the manager's lease: whatever it still holds is freed.
  ~KvManager();
  KvManager(const KvManager&) = delete;
  KvManager& operator=(const KvManager&) = delete;

  // Grows seq_ids[b] by q_lens[b] tokens and lays the step out. A sequence
  // not seen before starts empty. On any error nothing changes: bad
  // arguments (INVALID_ARGUMENT naming the field), no pages
  // (RESOURCE_EXHAUSTED), a sequence whose last Run() of some layer failed
  // (FAILED_PRECONDITION naming the sequences and the layer: run it again
  // first), lost sequences (DATA_LOSS naming them: Finish them), or the
  // failed call's error.
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
  // stale (their server plans are gone). Sequences it started are forgotten
  // (one that existed before it, even empty, stays).
  // For a cluster whose step failed on another server. The bookkeeping is
  // taken back whatever happens; an error says the frees failed (as for
  // Finish()).
  absl::Status Undo(const std::shared_ptr<const StepPlan>& plan);

  // One layer of a step: appends k_new, v_new (total_q, kv_heads, head_dim;
  // on an MLA server k_new holds the latent rows and v_new is empty)
  // at the plan's slots, then attends with q (total_q, qo_heads, head_dim).
  // `plan` defaults to the latest; a plan whose sequences a later Plan() or
  // Finish() touched is stale (FAILED_PRECONDITION). A Run() that fails may
  // or may not have appended that layer's rows: until that layer of that
  // plan has run again successfully, Plan() refuses its sequences.
  absl::StatusOr<PrefillResult> Run(int32_t layer, absl::Span<const uint16_t> q,
                                    absl::Span<const uint16_t> k_new,
                                    absl::Span<const uint16_t> v_new,
                                    const StepPlan* plan = nullptr);

  // Releases the sequences' plans, frees their pages (one FreePages) and
  // forgets them. Unknown or repeated ids (NOT_FOUND, INVALID_ARGUMENT)
  // change nothing; otherwise the sequences are forgotten whatever happens
  // (lost ones without an RPC), and an error says that freeing their pages
  // could not be confirmed: with the lease they are freed at the next
  // Plan(), Finish() or Release() (or when the lease ends); without it,
  // pages that may or may not have been freed are leaked (Leaked()).
  absl::Status Finish(absl::Span<const int64_t> seq_ids);
  // Forgets every sequence (lost ones too) and frees everything the manager
  // holds: Finish() of every sequence (FreePages answers once the pages are
  // zeroed and free), then, with the lease, its revocation, which releases
  // whatever a failure left under it (OK once that succeeds; if it fails, it
  // is tried again at the next call, and the lease ends within its ttl
  // anyway). The next Plan() starts a new lease.
  absl::Status Release();
  // Forgets every sequence and plan without an RPC (the server restarted;
  // then client->ForgetIncarnation() once the state is re-created). With
  // restarted false (the manager's lease was found gone on a server that
  // did not restart), the earlier leases still to revoke are kept: the
  // server may hold them, and the next call or Release() revokes them.
  void Reset(bool restarted = true);
  // As Reset(), for a server that cannot be reached: with the lease, the
  // server frees everything within the lease's ttl; without, the pages the
  // manager held are counted as leaked.
  void Abandon();

  // OK, or FAILED_PRECONDITION naming the sequences among seq_ids whose last
  // Run() of some layer failed (Plan() would refuse them).
  absl::Status CheckWritten(absl::Span<const int64_t> seq_ids) const;

  // Length of a sequence; -1 when unknown (or lost).
  int64_t KvLen(int64_t seq_id) const;
  // True for a sequence the manager knows: live, or lost and not finished.
  bool Has(int64_t seq_id) const;
  // Its pages, in order (empty when unknown).
  std::vector<int32_t> PagesOf(int64_t seq_id) const;
  // Pages this manager's live sequences hold on the server.
  int64_t NumPages() const;
  std::vector<int64_t> Sequences() const;  // live
  std::vector<int64_t> Lost() const;       // lost (the lease expired), not yet finished
  // Pages given up without a lease: a free or allocation whose outcome is
  // unknown (they may still be held on the server; never reused).
  int64_t Leaked() const { return leaked_; }
  // The manager's lease (0: none yet, or leases off).
  uint64_t lease_id() const { return keeper_ == nullptr ? 0 : keeper_->id(); }
  int32_t page_size() const { return page_size_; }
  // False once a server answered CreatePlan with UNIMPLEMENTED.
  bool server_plans() const { return options_.server_plans; }
  // False with options.lease false, or once a server answered GrantLease
  // with UNIMPLEMENTED.
  bool leases() const { return options_.lease; }

 private:
  struct Sequence {
    std::vector<int32_t> pages;
    int64_t length = 0;
    std::shared_ptr<const StepPlan> plan;  // the latest plan that includes it
    std::vector<int32_t> unwritten;        // layers of `plan` whose Run() failed, ascending
    int64_t started_step = 0;              // the step of the plan that started it
  };

  Client* rpc() const { return own_ != nullptr ? own_.get() : client_; }
  // Whether `plan` is the latest plan of its first sequence here (a plan of
  // another manager may carry a step number live here).
  bool IsLatestPlan(const StepPlan* plan) const;
  // PlanRows() once.
  absl::StatusOr<std::shared_ptr<const StepPlan>> PlanOnce(absl::Span<const int64_t> seq_ids,
                                                           absl::Span<const int32_t> append_lens,
                                                           absl::Span<const int32_t> q_rows,
                                                           absl::Span<const int32_t> kv_keys_after,
                                                           absl::Span<const uint8_t> apply_sinks);
  // The attention options of `layer`.
  const AttentionOptions& AttentionOf(int32_t layer) const;
  // Marks a sequence's plan stale; its server plan waits in unreleased_.
  void Retire(const std::shared_ptr<const StepPlan>& plan);
  // `plan` goes stale with `gone` lost mid-step: its other sequences record
  // the layers no Run() completed as unwritten, which no Run() can write
  // now (CheckWritten then refuses them until they are finished).
  void MarkUnrun(const StepPlan& plan, const absl::flat_hash_set<int64_t>& gone);
  // ReleasePlan of the stale server plans; NOT_FOUND counts as released.
  absl::Status ReleaseStale();
  // Before a call that allocates: the lease (a new one when there is none,
  // every sequence lost when it expired) and the reconciliation of what a
  // failed call left in doubt.
  absl::Status Prepare();
  // Lease mode: frees what the lease holds that no live sequence owns and
  // releases the plans the manager does not know (ListHoldings).
  absl::Status Reconcile();
  // Frees pages no sequence owns any more (and the stale plans first).
  absl::Status FreeUnowned(std::vector<int32_t> pages);
  // Without a lease: FreePages of to_free_, best effort.
  void FreePending();
  // A call failed with `s`: a lease that expired loses every sequence
  // (DATA_LOSS naming them); an outcome that is unknown marks the lease's
  // holdings for reconciliation (or, without a lease, counts
  // `leak_if_unknown` pages as leaked). Returns the status to report.
  absl::Status Failed(const absl::Status& s, int64_t leak_if_unknown = 0);
  // Every sequence is lost (the lease is gone); returns them.
  std::vector<int64_t> LoseAll();
  // Forgets every sequence, plan and page without an RPC.
  void ClearBookkeeping();
  // Stops renewing the lease without an RPC.
  void EndLease();
  // RevokeLease of the leases in unrevoked_.
  absl::Status RevokeEnded();
  // The plan ids of live plans.
  absl::flat_hash_set<uint64_t> LivePlanIds() const;

  Client* client_;
  KvManagerOptions options_;
  int32_t page_size_;
  int64_t step_ = 0;
  absl::flat_hash_map<int64_t, Sequence> seqs_;
  std::shared_ptr<const StepPlan> latest_;
  absl::flat_hash_set<int64_t> live_steps_;  // plans no later plan or Finish touched
  // Each live step's layers that a Run() completed, ascending.
  absl::flat_hash_map<int64_t, std::vector<int32_t>> ran_layers_;
  std::vector<uint64_t> unreleased_;
  absl::flat_hash_set<int64_t> lost_;        // sequences lost with a lease, not yet finished
  // Lease mode: a fork of client_ holding the lease (declared before
  // keeper_, which uses it, so that it is destroyed after).
  std::unique_ptr<Client> own_;
  std::unique_ptr<LeaseKeeper> keeper_;
  std::vector<uint64_t> unrevoked_;  // ended leases whose revocation is not confirmed
  bool dirty_ = false;            // lease mode: holdings may differ from the bookkeeping
  std::vector<int32_t> to_free_;  // no lease: pages surely held, owned by no sequence
  int64_t leaked_ = 0;
};

}  // namespace attnserve
