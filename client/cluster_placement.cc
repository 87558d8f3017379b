#include "client/cluster_placement.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnserve {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool Holds(const std::vector<Shard>& shards, int32_t server) {
  return std::any_of(shards.begin(), shards.end(),
                     [&](const Shard& sh) { return sh.server == server; });
}

}  // namespace

std::vector<int64_t> CausalSpread(int64_t n, int64_t k) {
  // Every new token's query attends to the new keys before it: a triangle of
  // n^2 / 2. The keys [a, n) take (n - a)^2 / 2 of it, so the last m of k
  // shards start at n (1 - sqrt(m / k)).
  std::vector<int64_t> sizes(std::max<int64_t>(k, 1), 0);
  int64_t prev = 0;
  for (int64_t j = 1; j <= k; ++j) {
    const int64_t bound =
        j == k ? n
               : static_cast<int64_t>(std::floor(
                     static_cast<double>(n) *
                         (1.0 - std::sqrt(static_cast<double>(k - j) / static_cast<double>(k))) +
                     0.5));
    sizes[j - 1] = std::max<int64_t>(0, bound - prev);
    prev = std::max(prev, bound);
  }
  return sizes;
}

absl::StatusOr<std::vector<std::vector<Chunk>>> PlaceTokens(
    absl::Span<const int64_t> seq_ids, absl::Span<const int32_t> q_lens,
    absl::Span<const std::vector<Shard>> shards, const PlacementRules& rules,
    std::vector<int64_t>* free) {
  const int64_t ps = rules.page_size;
  const int32_t num_servers = static_cast<int32_t>(free->size());
  std::vector<std::vector<Chunk>> chunks(seq_ids.size());
  for (size_t b = 0; b < seq_ids.size(); ++b) {
    const std::vector<Shard>& held = shards[b];
    const int64_t n = q_lens[b];
    // Candidates: the last server holding the sequence, then servers not
    // holding it, most free pages first.
    std::vector<int32_t> order;
    std::vector<int32_t> others;
    const int64_t tail_len = held.empty() ? 0 : held.back().length;
    if (!held.empty()) order.push_back(held.back().server);
    for (int32_t i = 0; i < num_servers; ++i) {
      if ((*free)[i] >= 0 && !Holds(held, i)) others.push_back(i);
    }
    std::stable_sort(others.begin(), others.end(),
                     [&](int32_t x, int32_t y) { return (*free)[x] > (*free)[y]; });
    int64_t room = rules.max_servers_per_sequence > 0
                       ? rules.max_servers_per_sequence - static_cast<int64_t>(held.size())
                       : static_cast<int64_t>(others.size());
    for (int32_t i : others) {
      if (room-- <= 0) break;
      order.push_back(i);
    }
    if (order.empty()) return absl::UnavailableError("no server of the cluster is reachable");
    // Desired counts: all on the first candidate, or spread over them all.
    std::vector<int64_t> want(order.size(), 0);
    const bool spread = rules.split_min_tokens > 0 && n >= rules.split_min_tokens;
    const std::vector<int64_t> sizes = CausalSpread(n, spread ? static_cast<int64_t>(order.size()) : 1);
    std::copy(sizes.begin(), sizes.end(), want.begin());
    // Each server takes what fits in its free pages (the sequence's last
    // server also the free rows of its last page); the rest moves on.
    int64_t carry = 0;
    for (size_t j = 0; j < order.size(); ++j) {
      const int32_t srv = order[j];
      const bool tail = j == 0 && !held.empty();
      const int64_t base = tail ? tail_len : 0;
      const int64_t cap = std::max<int64_t>(0, (*free)[srv]) * ps + (CeilDiv(base, ps) * ps - base);
      const int64_t desired = want[j] + carry;
      const int64_t take = std::min(desired, cap);
      carry = desired - take;
      if (take > 0 || (j == 0 && n == 0 && held.empty())) {
        chunks[b].push_back(Chunk{srv, take});
        (*free)[srv] -= CeilDiv(base + take, ps) - CeilDiv(base, ps);
      }
    }
    if (carry > 0) {
      // Servers with free pages that hold an earlier range of the sequence
      // cannot take its new tokens: a sequence's positions on one server
      // are one contiguous range (docs/cluster.md, "Placement").
      std::vector<int32_t> held_with_room;
      for (size_t j = 0; j + 1 < held.size(); ++j) {
        const int32_t srv = held[j].server;
        if ((*free)[srv] > 0 && srv != held.back().server &&
            std::find(held_with_room.begin(), held_with_room.end(), srv) == held_with_room.end()) {
          held_with_room.push_back(srv);
        }
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          "sequence ", seq_ids[b], ": ", carry, " of its ", n,
          " new tokens fit on no server (too few free pages",
          rules.max_servers_per_sequence > 0
              ? absl::StrCat(", or max_servers_per_sequence=", rules.max_servers_per_sequence)
              : "",
          ")",
          held_with_room.empty()
              ? ""
              : absl::StrCat("; the servers with free pages (", absl::StrJoin(held_with_room, ", "),
                             ", as Servers() lists them) hold earlier positions of it, and a sequence's "
                             "positions on one server are one range: finish it and start it again, or add "
                             "a server")));
    }
  }
  return chunks;
}

StepShares ShareStep(absl::Span<const int32_t> q_lens, absl::Span<const std::vector<Shard>> shards,
                     absl::Span<const int64_t> lengths, absl::Span<const std::vector<Chunk>> chunks,
                     int32_t num_servers, bool causal) {
  StepShares out;
  out.per_server.resize(num_servers);
  out.shards_after.resize(q_lens.size());
  out.length_after.resize(q_lens.size());
  for (size_t b = 0; b < q_lens.size(); ++b) {
    std::vector<Shard>& after = out.shards_after[b];
    after = shards[b];
    const int64_t start = lengths[b];
    int64_t offset = 0;
    std::vector<int64_t> appended(after.size() + chunks[b].size(), 0);
    for (const Chunk& c : chunks[b]) {
      if (!after.empty() && after.back().server == c.server) {
        after.back().length += c.count;
      } else {
        after.push_back(Shard{c.server, start + offset, c.count});
      }
      appended[after.size() - 1] = c.count;
      offset += c.count;
    }
    out.length_after[b] = start + q_lens[b];
    for (size_t j = 0; j < after.size(); ++j) {
      const Shard& sh = after[j];
      const int64_t end = sh.start + sh.length;
      // The step's row r is position start + r: it sees this shard from
      // position sh.start on (causal), so the rows before do not go there.
      const int64_t skip = causal ? std::clamp<int64_t>(sh.start - start, 0, q_lens[b]) : 0;
      out.per_server[sh.server].push_back(
          ShareEntry{b, static_cast<int32_t>(appended[j]), std::max<int64_t>(0, end - appended[j] - start),
                     end, static_cast<int32_t>(skip), sh.start == 0});
    }
  }
  return out;
}

}  // namespace attnserve
