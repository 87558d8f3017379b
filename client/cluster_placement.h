// Cluster::Plan's two decisions (client/cluster.h), as functions of the
// sequences' shards and the servers' free pages alone, so that they are
// read and tested apart from the servers: where each sequence's new tokens
// go (PlaceTokens), and what each server then computes for the step
// (ShareStep). docs/cluster.md states the rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/cluster.h"

namespace attnserve {

struct PlacementRules {
  int64_t page_size = 1;
  int32_t split_min_tokens = 0;          // ClusterOptions
  int32_t max_servers_per_sequence = 0;  // ClusterOptions (0: any number)
};

// A run of one sequence's new tokens on one server.
struct Chunk {
  int32_t server = 0;
  int64_t count = 0;
};

// Where the step's new tokens go: for sequence b (q_lens[b] new tokens,
// shards[b] its shards before the step, empty for a new one), its chunks in
// position order. (*free)[i] is server i's free pages (-1: it takes no new
// tokens), less what the chunks use. Candidates: the sequence's last server
// (its last page's free rows first), then the servers not holding it, most
// free pages first, at most max_servers_per_sequence in all; the tokens go
// to the first, or spread over all of them by CausalSpread when the step
// appends at least split_min_tokens; what a server cannot hold moves on to
// the next. A new sequence without tokens still gets one chunk (of 0).
// UNAVAILABLE when no server is a candidate, RESOURCE_EXHAUSTED naming the
// sequence when its tokens fit nowhere; *free is then in no defined state.
absl::StatusOr<std::vector<std::vector<Chunk>>> PlaceTokens(
    absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens,
    absl::Span<const std::vector<Shard>> shards, const PlacementRules& rules,
    std::vector<int64_t>* free);

// One shard's part in a step: the step's rows of sequence b that see some of
// the shard go to its server, with the new tokens appended there.
struct ShareEntry {
  size_t b = 0;
  int32_t append = 0;  // new tokens appended to this shard
  int64_t offset = 0;  // the first of them, within the sequence's new tokens
  int64_t end = 0;     // the shard's end position after the step
  int32_t skip = 0;    // the step's first rows that see nothing here (causal)
  bool first = false;  // the shard holds the sequence's first keys: it carries the sinks
};

struct StepShares {
  std::vector<std::vector<ShareEntry>> per_server;  // [server]: in sequence order
  std::vector<std::vector<Shard>> shards_after;     // [batch]
  std::vector<int64_t> length_after;                // [batch]
};

// The step's shares once its tokens are placed: every shard of a sequence
// (old and new) attends with the step's rows of that sequence (all of them;
// causal: those at or after the shard's first position).
StepShares ShareStep(absl::Span<const int32_t> q_lens, absl::Span<const std::vector<Shard>> shards,
                     absl::Span<const int64_t> lengths, absl::Span<const std::vector<Chunk>> chunks,
                     int32_t num_servers, bool causal);

}  // namespace attnserve
