// Cluster::Plan's placement and shares (client/cluster_placement.h), apart
// from any server.
#include "client/cluster_placement.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

MATCHER_P2(IsChunk, server, count, "") { return arg.server == server && arg.count == count; }

PlacementRules Rules(int64_t page_size, int32_t split_min_tokens = 0, int32_t max_servers = 0) {
  PlacementRules r;
  r.page_size = page_size;
  r.split_min_tokens = split_min_tokens;
  r.max_servers_per_sequence = max_servers;
  return r;
}

TEST(PlaceTokensTest, ANewSequenceGoesToTheServerWithTheMostFreePages) {
  std::vector<int64_t> free = {3, 9, 9, 2};
  const std::vector<std::vector<Shard>> shards(2);
  auto chunks = PlaceTokens({7, 8}, {20, 0}, shards, Rules(4), &free);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  // 20 tokens take 5 of server 1's pages (the first of the two with 9);
  // then server 2 has the most, and a sequence without tokens lives there.
  EXPECT_THAT((*chunks)[0], ::testing::ElementsAre(IsChunk(1, 20)));
  EXPECT_THAT((*chunks)[1], ::testing::ElementsAre(IsChunk(2, 0)));
  EXPECT_THAT(free, ::testing::ElementsAre(3, 4, 9, 2));
}

TEST(PlaceTokensTest, AppendsFillTheLastPageThenSpillToTheServerWithTheMostFreePages) {
  // Sequence 5 holds 10 rows on server 2 (pages of 4: 2 rows free in its
  // last page) and 1 free page there; 9 new tokens: 2 + 4 on server 2, the
  // other 3 on server 0 (more free pages than server 1; server 3 takes no
  // new tokens).
  std::vector<int64_t> free = {5, 2, 1, -1};
  const std::vector<std::vector<Shard>> shards = {{Shard{2, 0, 10}}};
  auto chunks = PlaceTokens({5}, {9}, shards, Rules(4), &free);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  EXPECT_THAT((*chunks)[0], ::testing::ElementsAre(IsChunk(2, 6), IsChunk(0, 3)));
  EXPECT_THAT(free, ::testing::ElementsAre(4, 2, 0, -1));
}

TEST(PlaceTokensTest, ALongStepSpreadsOverEveryCandidateByCausalSpread) {
  std::vector<int64_t> free = {100, 100, 100};
  const std::vector<std::vector<Shard>> shards(1);
  auto spread = PlaceTokens({1}, {37}, shards, Rules(1, /*split_min_tokens=*/32), &free);
  ASSERT_TRUE(spread.ok()) << spread.status();
  const std::vector<int64_t> sizes = CausalSpread(37, 3);
  EXPECT_THAT((*spread)[0], ::testing::ElementsAre(IsChunk(0, sizes[0]), IsChunk(1, sizes[1]),
                                                   IsChunk(2, sizes[2])));
  // Below split_min_tokens: one server.
  free = {100, 100, 100};
  auto one = PlaceTokens({1}, {31}, shards, Rules(1, 32), &free);
  ASSERT_TRUE(one.ok());
  EXPECT_THAT((*one)[0], ::testing::ElementsAre(IsChunk(0, 31)));
}

TEST(PlaceTokensTest, TokensThatFitNowhereNameTheSequenceAndTheLimit) {
  const std::vector<std::vector<Shard>> shards = {{Shard{0, 0, 8}}};
  std::vector<int64_t> free = {0, 1, 5};
  // max_servers_per_sequence = 2: server 0 (full) and the one with most free
  // pages (server 2: 5 pages of 2 rows) hold 10 of the 12 tokens.
  auto chunks = PlaceTokens({42}, {12}, shards, Rules(2, 0, /*max_servers=*/2), &free);
  EXPECT_EQ(chunks.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(chunks.status().message(),
              HasSubstr("sequence 42: 2 of its 12 new tokens fit on no server (too few free "
                        "pages, or max_servers_per_sequence=2)"));
  // Without the limit, server 1 takes the rest.
  free = {0, 1, 5};
  auto all = PlaceTokens({42}, {12}, shards, Rules(2), &free);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_THAT((*all)[0], ::testing::ElementsAre(IsChunk(2, 10), IsChunk(1, 2)));
}

// A sequence spread over two servers whose last server is full cannot grow
// on the first, which has room: its positions there are one range. The
// error says so, naming that server.
TEST(PlaceTokensTest, ServersHoldingEarlierPositionsAreNamedWhenTheyHaveRoom) {
  const std::vector<std::vector<Shard>> shards = {{Shard{0, 0, 4}, Shard{1, 4, 12}}};
  std::vector<int64_t> free = {7, 0};
  auto chunks = PlaceTokens({5}, {1}, shards, Rules(4), &free);
  EXPECT_EQ(chunks.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(chunks.status().message(),
              HasSubstr("sequence 5: 1 of its 1 new tokens fit on no server (too few free pages); the "
                        "servers with free pages (0, as Servers() lists them) hold earlier positions of it"));
  // With no room there either, only the pages are short.
  free = {0, 0};
  auto full = PlaceTokens({5}, {1}, shards, Rules(4), &free);
  EXPECT_EQ(full.status().message(), "sequence 5: 1 of its 1 new tokens fit on no server (too few free pages)");
}

TEST(PlaceTokensTest, NoServerTakingTokensIsUnavailable) {
  std::vector<int64_t> free = {-1, -1};
  const std::vector<std::vector<Shard>> shards(1);
  auto chunks = PlaceTokens({3}, {1}, shards, Rules(16), &free);
  EXPECT_EQ(chunks.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(chunks.status().message(), HasSubstr("no server of the cluster is reachable"));
}

TEST(PlaceTokensTest, EachSequenceSeesThePagesTheOnesBeforeItTook) {
  std::vector<int64_t> free = {2, 3};
  const std::vector<std::vector<Shard>> shards(3);
  auto chunks = PlaceTokens({1, 2}, {48, 32}, absl::MakeConstSpan(shards).subspan(0, 2), Rules(16),
                            &free);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  EXPECT_THAT((*chunks)[0], ::testing::ElementsAre(IsChunk(1, 48)));  // 3 pages of server 1
  EXPECT_THAT((*chunks)[1], ::testing::ElementsAre(IsChunk(0, 32)));  // 2 of server 0
  EXPECT_THAT(free, ::testing::ElementsAre(0, 0));
  // Nothing is left for a third.
  free = {2, 3};
  auto none = PlaceTokens({1, 2, 3}, {48, 32, 1}, shards, Rules(16), &free);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(none.status().message(), HasSubstr("sequence 3: 1 of its 1 new tokens"));
}

TEST(ShareStepTest, EveryShardAttendsWithTheRowsThatSeeIt) {
  // Sequence 0: 10 keys on server 0; 6 new tokens, 3 there and 3 on server 1.
  // Sequence 1: new, 4 tokens on server 1.
  const std::vector<std::vector<Shard>> shards = {{Shard{0, 0, 10}}, {}};
  const std::vector<std::vector<Chunk>> chunks = {{Chunk{0, 3}, Chunk{1, 3}}, {Chunk{1, 4}}};
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal);
    const StepShares s = ShareStep({6, 4}, shards, {10, 0}, chunks, /*num_servers=*/3, causal);
    EXPECT_THAT(s.length_after, ::testing::ElementsAre(16, 4));
    ASSERT_EQ(s.shards_after[0].size(), 2u);
    EXPECT_EQ(s.shards_after[0][0].length, 13);
    EXPECT_EQ(s.shards_after[0][1].server, 1);
    EXPECT_EQ(s.shards_after[0][1].start, 13);
    EXPECT_EQ(s.shards_after[0][1].length, 3);
    ASSERT_EQ(s.per_server[0].size(), 1u);
    const ShareEntry& a = s.per_server[0][0];
    EXPECT_EQ(a.b, 0u);
    EXPECT_EQ(a.append, 3);
    EXPECT_EQ(a.offset, 0);
    EXPECT_EQ(a.end, 13);
    EXPECT_EQ(a.skip, 0);
    EXPECT_TRUE(a.first);
    ASSERT_EQ(s.per_server[1].size(), 2u);
    const ShareEntry& b = s.per_server[1][0];
    EXPECT_EQ(b.append, 3);
    EXPECT_EQ(b.offset, 3);
    EXPECT_EQ(b.end, 16);
    // Causal: the step's rows 0 .. 2 (positions 10 .. 12) see nothing of
    // positions 13 on.
    EXPECT_EQ(b.skip, causal ? 3 : 0);
    EXPECT_FALSE(b.first);
    const ShareEntry& c = s.per_server[1][1];
    EXPECT_EQ(c.b, 1u);
    EXPECT_EQ(c.append, 4);
    EXPECT_EQ(c.end, 4);
    EXPECT_TRUE(c.first);
    EXPECT_TRUE(s.per_server[2].empty());
  }
}

TEST(ShareStepTest, AShardWithoutNewTokensStillAttends) {
  // Keys 0 .. 7 on server 0 and 8 .. 11 on server 1; 2 new tokens on server 1.
  const std::vector<std::vector<Shard>> shards = {{Shard{0, 0, 8}, Shard{1, 8, 4}}};
  const StepShares s = ShareStep({2}, shards, {12}, {{Chunk{1, 2}}}, 2, /*causal=*/true);
  ASSERT_EQ(s.per_server[0].size(), 1u);
  EXPECT_EQ(s.per_server[0][0].append, 0);
  EXPECT_EQ(s.per_server[0][0].end, 8);
  EXPECT_EQ(s.per_server[0][0].skip, 0);
  ASSERT_EQ(s.per_server[1].size(), 1u);
  EXPECT_EQ(s.per_server[1][0].append, 2);
  EXPECT_EQ(s.per_server[1][0].offset, 0);
  EXPECT_EQ(s.per_server[1][0].end, 14);
  EXPECT_EQ(s.shards_after[0].back().length, 6);
}

}  // namespace
}  // namespace attnserve
