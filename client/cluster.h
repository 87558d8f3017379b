// Many attnserve servers behind one client: placement, routing and context
// parallelism. docs/cluster.md is the contract; attnserve.Cluster
// (client/python/attnserve/cluster.py) is the Python twin.
//
// One server owns one GPU and its KV cache is local state, so the cluster
// keeps every sequence's keys on the servers it placed them on. Each server
// has its own KvManager (client/kv_manager.h), which keeps that server's
// pages, plans and layouts exactly as for a single server; the cluster sits
// on top with the same plan / run / finish API:
//
//   ClusterOptions options;
//   options.targets = {"dns:///attnserve-pods.attnserve.svc.cluster.local:50051"};
//   auto cluster = Cluster::Connect(options);           // every server's Info
//   auto step = (*cluster)->Plan({7, 9}, {5, 3});        // places 7 and 9
//   for (int32_t layer = 0; layer < num_layers; ++layer) {
//     // q (8, qo_heads, head_dim); k, v (8, kv_heads, head_dim): the caller's order
//     auto out = (*cluster)->Run(layer, q, k, v);        // one round trip per server
//   }
//   (*cluster)->Finish({7});
//
// Placement: a new sequence goes to the server with the most free pages and
// stays there. Context parallelism: a sequence is spread over several
// servers, each holding a contiguous range of its positions, when its
// server runs out of pages or when one step appends at least
// split_min_tokens tokens to it; every server that holds part of it gets
// the sequence's query rows and the merge by LSE (kernels/merge_states.h,
// the server's own CPU merge) gives the attention over the whole sequence.
//
// Restarts: a server whose incarnation changed lost its KV. Every sequence
// with keys there is lost: the call that found out fails with DATA_LOSS
// naming them (LostSequences() reads the ids back), the rest of the cluster
// keeps working, and Finish() of the lost sequences frees what they held on
// the other servers. So is every sequence of a server whose KvManager's
// lease expired, or that stayed unreachable for server_lost_after_s.
//
// Partial failures (docs/cluster.md, "When a call fails"): Finish() forgets
// every sequence it names whatever happens, and says which servers could
// not confirm freeing their pages; each server's KvManager holds its pages
// under a lease and reconciles what a failed call left in doubt.
//
// Not thread-safe: one thread plans, runs and finishes (Run() itself calls
// the servers concurrently).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"
#include "client/kv_manager.h"
#include "common/kv_geometry.h"

namespace attnserve {

struct ClusterOptions {
  // The servers: "host:port" each, or one "dns:///NAME:PORT" whose addresses
  // (getaddrinfo, e.g. a Kubernetes headless Service) are the servers.
  std::vector<std::string> targets;
  // Token, TLS and deadlines of every server's client (its target is unused).
  ClientOptions client;
  // Options of every server's KvManager (causal, sm_scale, lse_base, plans, the
  // attention options; a spread sequence takes its sinks on the server holding
  // its first keys only).
  KvManagerOptions kv;
  // Plan() runs Refresh() (a dns:/// target resolved again, every server's
  // Info read: free pages, restarts, unreachable servers back) once this
  // many seconds have passed since the last one, or when no server takes new
  // sequences.
  double refresh_interval_s = 30;
  // A step that appends at least this many tokens to one sequence spreads
  // them over several servers, in ranges that share the causal attention
  // work evenly (CausalSpread; 0: never; a sequence is still spread when
  // its server has too few free pages).
  int32_t split_min_tokens = 0;
  // At most this many servers hold one sequence (0: any number).
  int32_t max_servers_per_sequence = 0;
  // A server whose calls fail with UNAVAILABLE or DEADLINE_EXCEEDED for this
  // many seconds (from the first such failure, with no success since) has
  // its sequences declared lost (DATA_LOSS naming them): Finish() of them
  // then succeeds without it. It takes new sequences again once Refresh()
  // reaches it. 0: at its first such failure; negative: never. The default
  // is twice the servers' default lease ttl (30 s), so that a server back
  // from a partition has already freed what the lost sequences held.
  double server_lost_after_s = 60;
  // Resolves a dns:/// target's host and port to "ip:port" addresses;
  // getaddrinfo when unset (tests put their own here).
  std::function<absl::StatusOr<std::vector<std::string>>(const std::string& host,
                                                         const std::string& port)>
      resolver;
};

// Where a sequence's keys are: positions [start, start + length) on a server.
struct Shard {
  int32_t server = 0;
  int64_t start = 0;
  int64_t length = 0;
};

// One step of a cluster, in the caller's terms. Shapes in brackets.
struct ClusterStep {
  int64_t step = 0;                   // 1, 2, ... per Plan()
  std::vector<int64_t> seq_ids;       // [batch], in the caller's order
  std::vector<int32_t> q_lens;        // [batch] new tokens
  std::vector<int64_t> kv_lens;       // [batch] lengths after the step
  std::vector<int32_t> qo_indptr;     // [batch + 1] rows of q, k_new, v_new
  std::vector<int64_t> positions;     // [total_q] each new token's position

  // One server's share of the step.
  struct Part {
    int32_t server = 0;
    int64_t epoch = 0;                       // the server's restart count at Plan()
    std::shared_ptr<const StepPlan> plan;    // that server's KvManager step
    std::vector<int32_t> q_rows;             // [plan rows] the caller's row of each
    std::vector<int32_t> append_rows;        // [plan appends] the caller's row of each
  };
  std::vector<Part> parts;
  // Where a sequence's rows come back from one server: rows [skip, q_len)
  // of the sequence (a causal row sees nothing of a range that starts after
  // it, so it is not sent there) at `row` of part `part`'s output.
  struct Source {
    int32_t part = 0;
    int32_t row = 0;
    int32_t skip = 0;
  };
  // [batch]: every server holding part of the sequence; more than one means
  // a merge.
  std::vector<std::vector<Source>> sources;

  int64_t total_q() const { return qo_indptr.empty() ? 0 : qo_indptr.back(); }
};

// What one server looks like to the cluster.
struct ClusterServer {
  std::string address;
  bool active = true;         // takes new sequences (listed, reachable)
  uint64_t incarnation = 0;
  int64_t restarts = 0;       // restarts seen
  int64_t free_pages = 0;     // estimate: its last Info, less what we allocated since
  int64_t pages_held = 0;     // held by this cluster's sequences
  int64_t sequences = 0;      // sequences with keys there
  int64_t leaked_pages = 0;   // its KvManager's Leaked() (without leases)
};

// How a step spreads n new tokens of one sequence over k servers, in
// position order: sizes that give each server the same share of the causal
// attention among the new tokens (the first shard is the smallest: every
// later query reads it). Sums to n.
std::vector<int64_t> CausalSpread(int64_t n, int64_t k);

struct StepShares;  // client/cluster_placement.h

// LostSequences(status) (client/kv_manager.h) reads back the sequences a
// DATA_LOSS status of Cluster names.

class Cluster {
 public:
  // Connects to every server and reads its Info; fails when one cannot be
  // reached or their geometries (layers, page size, heads, head_dim, dtype)
  // differ, naming the server and the field.
  static absl::StatusOr<std::unique_ptr<Cluster>> Connect(const ClusterOptions& options);

  const KvGeometry& geometry() const { return geo_; }
  int32_t num_servers() const { return static_cast<int32_t>(servers_.size()); }
  std::vector<ClusterServer> Servers() const;
  // A server's client and KvManager (index as Servers()).
  Client* client(int32_t server) { return servers_[server]->client.get(); }
  KvManager* kv_manager(int32_t server) { return servers_[server]->kv.get(); }

  // Resolves a dns:/// target again (new servers join; a server that left
  // and cannot be reached loses its sequences) and reads every server's
  // Info (free pages; a changed incarnation loses its sequences; an
  // unreachable server takes no new sequences until it answers again).
  // DATA_LOSS naming the sequences found lost; FAILED_PRECONDITION naming a
  // new server whose geometry differs (it is left out). Plan() runs it every
  // refresh_interval_s.
  absl::Status Refresh();

  // As KvManager::Plan: seq_ids[b] grows by q_lens[b] tokens. New sequences
  // are placed, appended tokens go to each sequence's last server (spilling
  // to others when it is full, or spread when split_min_tokens says so).
  // Atomic: on any error nothing changes. DATA_LOSS naming the lost
  // sequences among seq_ids (finish them); RESOURCE_EXHAUSTED when the
  // cluster has too few free pages.
  absl::StatusOr<std::shared_ptr<const ClusterStep>> Plan(absl::Span<const int64_t> seq_ids,
                                                          absl::Span<const int32_t> q_lens);

  // One layer: q (total_q, qo_heads, head_dim) and k_new, v_new (total_q,
  // kv_heads, head_dim) in the caller's order; one Prefill per server
  // touched, all in flight at once; output in the caller's order. When a
  // server turns out to have restarted: DATA_LOSS naming its sequences, and
  // `partial` (if given) gets the output of the others (lost rows 0, LSE
  // -inf); the step stays runnable for them.
  absl::StatusOr<PrefillResult> Run(int32_t layer, absl::Span<const uint16_t> q,
                                    absl::Span<const uint16_t> k_new,
                                    absl::Span<const uint16_t> v_new,
                                    const ClusterStep* step = nullptr,
                                    PrefillResult* partial = nullptr);

  // Frees the sequences' pages on every server and forgets them (lost ones
  // too). Unknown or repeated ids (NOT_FOUND, INVALID_ARGUMENT) change
  // nothing; otherwise every named sequence is gone from the cluster
  // afterwards, whatever happens, and an error names the servers that could
  // not confirm freeing their pages and the sequences concerned (their
  // KvManagers free them later: docs/cluster.md). DATA_LOSS names other
  // sequences found lost meanwhile.
  absl::Status Finish(absl::Span<const int64_t> seq_ids);
  // Finish() of every sequence, then every server's KvManager::Release()
  // (its lease revoked), best effort.
  absl::Status Release();

  // FP8 servers: sets the KV scales (Client::SetKvScales) on every server,
  // and keeps them for servers that join or restart later (their scales
  // start at 1.0; a server that cannot take them takes no new sequences).
  // The first server's error names it; servers that took them keep them.
  absl::Status SetKvScales(absl::Span<const LayerKvScales> layers);

  int64_t KvLen(int64_t seq_id) const;      // -1 when unknown
  std::vector<Shard> ShardsOf(int64_t seq_id) const;
  std::vector<int64_t> Sequences() const;  // known and not lost
  std::vector<int64_t> Lost() const;       // lost, not yet finished

 private:
  struct Server {
    std::string address;
    std::unique_ptr<Client> client;
    std::unique_ptr<KvManager> kv;
    bool listed = true;      // in the last resolution (or a fixed target)
    bool reachable = true;
    bool gone = false;       // left the cluster: never used again
    uint64_t scales_incarnation = 0;  // the incarnation kv_scales_ were last given to
    int64_t epoch = 0;       // restarts seen
    int64_t free_base = 0;   // free_pages of the last Info
    int64_t held_base = 0;   // kv->NumPages() then
    // The first of the calls failing with UNAVAILABLE or DEADLINE_EXCEEDED
    // since the last success; nullopt while it answers.
    std::optional<absl::Time> unreachable_since;
  };
  // Why a server's sequences are lost.
  enum class Loss {
    kRestarted,    // a new incarnation: its KV is gone
    kLeaseLost,    // its KvManager's lease expired: the server freed its pages
    kUnreachable,  // unreachable past server_lost_after_s, or gone from the name
  };
  struct Sequence {
    std::vector<Shard> shards;  // in position order
    int64_t length = 0;
    bool lost = false;
    std::shared_ptr<const ClusterStep> step;  // latest step that includes it
  };

  Cluster() = default;
  // Plan() once; *again: a server it needed was found restarted (or its
  // lease gone) holding none of these sequences, and a second try may pass.
  absl::StatusOr<std::shared_ptr<const ClusterStep>> PlanOnce(absl::Span<const int64_t> seq_ids,
                                                              absl::Span<const int32_t> q_lens,
                                                              bool* again);
  // The sequences' shards on each server, and those of the other sequences
  // of their live steps, hold every layer of the last Run()
  // (KvManager::CheckWritten), naming the server where one does not.
  absl::Status CheckWritten(absl::Span<const int64_t> seq_ids);
  // Plans each server's share (PlanRows) into step->parts, in server order;
  // a failure takes back the plans before it and says what it found (*again
  // as PlanOnce).
  absl::Status PlanParts(absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens,
                         const StepShares& shares, ClusterStep* step, bool* again);
  // Takes new sequences: listed, reachable and not gone.
  static bool Usable(const Server& s) { return s.listed && s.reachable && !s.gone; }
  // A call that failed without reaching its server (UNAVAILABLE, DEADLINE_EXCEEDED).
  static bool Unreachable(const absl::Status& s) {
    return s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded;
  }
  absl::StatusOr<int32_t> AddServer(const std::string& address);
  // kv_scales_ to the server unless its incarnation has them already.
  absl::Status ApplyScales(int32_t server);
  absl::Status Resolve();
  int64_t FreeEstimate(const Server& s) const;
  void ReadInfo(int32_t server, const v1::ServerInfo& info);
  // The server's sequences are lost (or it left the cluster: `gone`);
  // returns them.
  std::vector<int64_t> LoseServer(int32_t server, Loss why, bool gone = false);
  // What a call to a server's KvManager answered says about the server: OK
  // marks it answering; a restart, a lost lease or an unreachability past
  // server_lost_after_s loses its sequences, appended to *lost (returns
  // true: the failure is accounted for by the loss).
  bool Observe(int32_t server, const absl::Status& status, std::vector<int64_t>* lost);
  static absl::Status LostError(absl::Span<const int64_t> ids, absl::string_view why);

  ClusterOptions options_;
  std::string dns_host_, dns_port_;  // set for a dns:/// target
  absl::Time refreshed_at_ = absl::Now();
  KvGeometry geo_;
  std::map<int32_t, LayerKvScales> kv_scales_;  // SetKvScales, by layer
  std::vector<std::unique_ptr<Server>> servers_;
  absl::flat_hash_map<int64_t, Sequence> seqs_;
  absl::flat_hash_set<int64_t> live_steps_;
  std::shared_ptr<const ClusterStep> latest_;
  int64_t step_ = 0;
};

}  // namespace attnserve
