// Cluster (client/cluster.h) against two and three real attnserve binaries
// (CPU backend, free ports): placement by free pages, routing in the
// caller's order, context parallelism (sequences spread over servers at page
// and non-page boundaries, page_size 1 and 16) checked layer by layer
// against the float64 reference over the whole sequence, a server restart
// that loses exactly its sequences, mixed geometries refused, and DNS
// discovery.
#include "client/cluster.h"

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

std::vector<std::unique_ptr<TestServer>> StartServers(const std::vector<TestServerOptions>& all) {
  std::vector<std::unique_ptr<TestServer>> servers;
  for (const TestServerOptions& o : all) {
    auto s = TestServer::Start(o);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) return {};
    servers.push_back(*std::move(s));
  }
  return servers;
}

ClusterOptions OptionsFor(const std::vector<std::unique_ptr<TestServer>>& servers) {
  ClusterOptions o;
  for (const auto& s : servers) o.targets.push_back(s->grpc_address());
  o.client.timeout_s = 120;
  return o;
}

// Refresh() until it reports something (a restart found: DATA_LOSS naming
// the lost sequences), while the restarted server's channel reconnects (it
// answers OK, the server unreachable), for up to 30 s.
absl::Status RefreshUntilItSaysMore(Cluster& c) {
  return RetryWhileUnavailable([&] {
    absl::Status r = c.Refresh();
    return r.ok() ? absl::UnavailableError("reconnecting") : r;
  });
}

// The whole sequences as one server would hold them: the test's own copy of
// every appended row, each sequence at its own slot range (page_size 1), and
// the float64 reference over it.
class Reference {
 public:
  explicit Reference(const KvGeometry& cluster_geo) : geo_(cluster_geo) {
    geo_.page_size = 1;
    geo_.num_pages = kSlotsPerSeq * 64;
    mirror_ = std::make_unique<KvMirror>(geo_);
  }
  // k, v (total_q, kv_heads, head_dim) of the step's new tokens.
  void Append(int32_t layer, const ClusterStep& step, absl::Span<const uint16_t> k,
              absl::Span<const uint16_t> v) {
    std::vector<int64_t> slots;
    for (size_t b = 0; b < step.seq_ids.size(); ++b) {
      for (int32_t i = 0; i < step.q_lens[b]; ++i) {
        slots.push_back(Base(step.seq_ids[b]) + step.kv_lens[b] - step.q_lens[b] + i);
      }
    }
    mirror_->Write(layer, slots, k, v);
  }
  // Attention of the step's rows over the whole sequences.
  Comparison Check(int32_t layer, const ClusterStep& step, absl::Span<const uint16_t> q,
                   const PrefillResult& got, const std::vector<int64_t>& skip = {}) {
    PrefillInputs in;
    in.layer = layer;
    in.qo_indptr = {0};
    in.kv_indptr = {0};
    std::vector<int64_t> keep_rows;
    for (size_t b = 0; b < step.seq_ids.size(); ++b) {
      if (std::find(skip.begin(), skip.end(), step.seq_ids[b]) != skip.end()) continue;
      for (int64_t p = 0; p < step.kv_lens[b]; ++p) {
        in.kv_indices.push_back(static_cast<int32_t>(Base(step.seq_ids[b]) + p));
      }
      in.kv_indptr.push_back(static_cast<int32_t>(in.kv_indices.size()));
      in.qo_indptr.push_back(in.qo_indptr.back() + step.q_lens[b]);
      for (int32_t r = step.qo_indptr[b]; r < step.qo_indptr[b + 1]; ++r) keep_rows.push_back(r);
    }
    const int64_t q_row = geo_.QRowElems(), o_row = geo_.ORowElems();
    std::vector<uint16_t> o;
    std::vector<float> lse;
    for (int64_t r : keep_rows) {
      in.q.insert(in.q.end(), q.begin() + r * q_row, q.begin() + (r + 1) * q_row);
      o.insert(o.end(), got.o.begin() + r * o_row, got.o.begin() + (r + 1) * o_row);
      lse.insert(lse.end(), got.lse.begin() + r * geo_.num_qo_heads,
                 got.lse.begin() + (r + 1) * geo_.num_qo_heads);
    }
    auto options = options_.find(layer);
    if (options != options_.end()) in.options = options->second;
    std::vector<double> o_ref, lse_ref;
    ReferencePrefill(*mirror_, in, &o_ref, &lse_ref);
    return Compare(geo_.dtype, o_ref, lse_ref, o, lse);
  }
  // The attention options of a layer (default: none).
  void SetOptions(int32_t layer, AttentionOptions options) { options_[layer] = options; }

 private:
  std::map<int32_t, AttentionOptions> options_;
  static constexpr int64_t kSlotsPerSeq = 4096;
  static int64_t Base(int64_t seq_id) { return seq_id * kSlotsPerSeq; }
  KvGeometry geo_;
  std::unique_ptr<KvMirror> mirror_;
};

// Runs every layer of `step` with random q, k, v and checks each against the
// reference.
void RunAndCheck(Cluster& cluster, Reference& ref, const ClusterStep& step, std::mt19937_64& gen) {
  const KvGeometry& g = cluster.geometry();
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    const int64_t n = step.total_q();
    auto q = RandomHalves(gen, g.dtype, n * g.num_qo_heads * g.head_dim);
    auto k = RandomHalves(gen, g.dtype, n * g.RowElems());
    auto v = RandomHalves(gen, g.dtype, g.HasVPool() ? n * g.RowElems() : 0);  // MLA: none
    ref.Append(layer, step, k, v);
    auto out = cluster.Run(layer, q, k, v, &step);
    ASSERT_TRUE(out.ok()) << out.status();
    const Comparison c = ref.Check(layer, step, q, *out);
    EXPECT_TRUE(c.Ok(g.dtype)) << "step " << step.step << " layer " << layer << ": "
                               << c.ToString();
  }
}

TEST(CausalSpreadTest, SharesTheCausalWorkOfTheNewTokens) {
  EXPECT_THAT(CausalSpread(37, 2), ElementsAre(11, 26));
  EXPECT_THAT(CausalSpread(37, 3), ElementsAre(7, 9, 21));
  EXPECT_THAT(CausalSpread(32768, 2), ElementsAre(9598, 23170));  // 1 - 1/sqrt(2)
  EXPECT_THAT(CausalSpread(0, 3), ElementsAre(0, 0, 0));
  EXPECT_THAT(CausalSpread(5, 1), ElementsAre(5));
  // Each shard's work, sum over queries r of the keys [a, b) it sees, is
  // within one row of the others'.
  for (int64_t k : {2, 3, 4}) {
    const int64_t n = 4000;
    const std::vector<int64_t> sizes = CausalSpread(n, k);
    int64_t a = 0, lo = INT64_MAX, hi = 0;
    for (int64_t size : sizes) {
      const int64_t b = a + size;
      int64_t work = 0;
      for (int64_t r = 0; r < n; ++r) work += std::max<int64_t>(0, std::min(r + 1, b) - a);
      lo = std::min(lo, work);
      hi = std::max(hi, work);
      a = b;
    }
    EXPECT_EQ(a, n);
    EXPECT_LT(static_cast<double>(hi - lo) / hi, 0.01) << k;
  }
}

TEST(ClusterTest, PlacesNewSequencesOnTheServerWithTheMostFreePages) {
  std::vector<TestServerOptions> opts(3);
  opts[0].num_pages = 40;
  opts[1].num_pages = 100;
  opts[2].num_pages = 70;
  auto servers = StartServers(opts);
  ASSERT_EQ(servers.size(), 3u);
  auto cluster = Cluster::Connect(OptionsFor(servers));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  // 16 tokens a page: sequence 1 takes 50 pages of server 1 (100 -> 50),
  // then 2 goes to server 2 (70), 3 to server 1 (50 > 40 > 30 left on 2)...
  auto step = c.Plan({1, 2, 3, 4}, {800, 640, 16, 16});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(c.ShardsOf(1)[0].server, 1);
  EXPECT_EQ(c.ShardsOf(2)[0].server, 2);  // 70 free against 50
  EXPECT_EQ(c.ShardsOf(3)[0].server, 1);  // 50 against 40 and 30
  EXPECT_EQ(c.ShardsOf(4)[0].server, 1);  // 49 against 40 and 30
  for (int64_t id : {1, 2, 3, 4}) EXPECT_EQ(c.ShardsOf(id).size(), 1u);
  const auto s = c.Servers();
  EXPECT_EQ(s[0].pages_held, 0);
  EXPECT_EQ(s[1].pages_held, 52);
  EXPECT_EQ(s[2].pages_held, 40);
  // The placement sticks: new tokens follow their sequence.
  auto next = c.Plan({4, 2}, {1, 1});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(c.ShardsOf(4)[0].server, 1);
  EXPECT_EQ(c.ShardsOf(2)[0].server, 2);
  ASSERT_TRUE(c.Release().ok());
  for (const auto& server : c.Servers()) EXPECT_EQ(server.pages_held, 0);
}

TEST(ClusterTest, RoutesABatchOverServersAndAnswersInTheCallersOrder) {
  auto servers = StartServers(std::vector<TestServerOptions>(3));
  ASSERT_EQ(servers.size(), 3u);
  auto cluster = Cluster::Connect(OptionsFor(servers));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  Reference ref(c.geometry());
  std::mt19937_64 gen(7);
  // Prompts of different lengths, interleaved over the servers, then decode
  // steps whose batch order differs from the placement order.
  auto step = c.Plan({10, 11, 12, 13, 14, 15}, {37, 5, 64, 1, 17, 30});
  ASSERT_TRUE(step.ok()) << step.status();
  std::vector<int32_t> used;
  for (int64_t id : {10, 11, 12, 13, 14, 15}) used.push_back(c.ShardsOf(id)[0].server);
  EXPECT_EQ(std::set<int32_t>(used.begin(), used.end()).size(), 3u) << "all servers used";
  RunAndCheck(c, ref, **step, gen);
  for (int round = 0; round < 3; ++round) {
    auto decode = c.Plan({15, 12, 10, 13, 11, 14}, {1, 1, 2, 1, 1, 3});
    ASSERT_TRUE(decode.ok()) << decode.status();
    RunAndCheck(c, ref, **decode, gen);
  }
  EXPECT_EQ(c.KvLen(10), 37 + 6);
  // Only one part per server touched.
  auto last = c.Plan({11, 13}, {1, 1});
  ASSERT_TRUE(last.ok());
  EXPECT_LE((*last)->parts.size(), 2u);
  RunAndCheck(c, ref, **last, gen);
  ASSERT_TRUE(c.Release().ok());
}

// Context parallelism: (page_size, servers) with the prompt spread evenly.
class ClusterSplitTest : public ::testing::TestWithParam<std::tuple<int32_t, int32_t>> {};

TEST_P(ClusterSplitTest, SpreadSequencesMatchTheReference) {
  const auto [page_size, num_servers] = GetParam();
  std::vector<TestServerOptions> opts(num_servers);
  for (auto& o : opts) {
    o.page_size = page_size;
    o.num_pages = 4096 / page_size;
  }
  auto servers = StartServers(opts);
  ASSERT_EQ(static_cast<int32_t>(servers.size()), num_servers);
  ClusterOptions options = OptionsFor(servers);
  options.split_min_tokens = 24;
  auto cluster = Cluster::Connect(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  Reference ref(c.geometry());
  std::mt19937_64 gen(page_size * 10 + num_servers);
  // 37 and 55 tokens spread (CausalSpread: 37 -> 11 + 26 or 7 + 9 + 21, never
  // at a page boundary of 16; 55 over 2 -> 16 + 39, at one), 5 stays whole.
  auto step = c.Plan({1, 2, 3}, {37, 5, 55});
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(static_cast<int32_t>(c.ShardsOf(1).size()), num_servers);
  EXPECT_EQ(c.ShardsOf(2).size(), 1u);
  EXPECT_EQ(static_cast<int32_t>(c.ShardsOf(3).size()), num_servers);
  int64_t pos = 0;
  for (const Shard& sh : c.ShardsOf(1)) {  // contiguous ranges, in order
    EXPECT_EQ(sh.start, pos);
    pos += sh.length;
  }
  EXPECT_EQ(pos, 37);
  // A causal row goes only to the servers whose range starts at or before it.
  size_t sent = 0, expected = 5;
  for (const auto& part : (*step)->parts) sent += part.q_rows.size();
  for (const Shard& sh : c.ShardsOf(1)) expected += 37 - sh.start;
  for (const Shard& sh : c.ShardsOf(3)) expected += 55 - sh.start;
  EXPECT_EQ(sent, expected);
  RunAndCheck(c, ref, **step, gen);
  // Decode: the new token goes to the last server, the query to all.
  for (int round = 0; round < 4; ++round) {
    auto decode = c.Plan({3, 1, 2}, {1, 1, 1});
    ASSERT_TRUE(decode.ok()) << decode.status();
    RunAndCheck(c, ref, **decode, gen);
  }
  // The last server got its share of the prompt, then every decode token.
  EXPECT_EQ(c.ShardsOf(1).back().length, CausalSpread(37, num_servers).back() + 4);
  if (num_servers == 2) EXPECT_EQ(c.ShardsOf(3)[0].length, 16);
  // A causal prefill chunk on a spread sequence: 30 more tokens of 1 (every
  // server holds part of it already, so they go to the last one).
  auto chunk = c.Plan({1}, {30});
  ASSERT_TRUE(chunk.ok()) << chunk.status();
  RunAndCheck(c, ref, **chunk, gen);
  ASSERT_TRUE(c.Release().ok());
}

// Attention variants on a cluster (docs/cluster.md): every server gets the
// window and the soft-cap, and a spread sequence's sinks enter its softmax on
// the server holding its first keys only, so that the merge by LSE counts
// them once; the whole sequence's float64 reference agrees at every layer.
TEST(ClusterTest, SpreadSequencesTakeTheirSinksOnce) {
  auto servers = StartServers(std::vector<TestServerOptions>(2));
  ASSERT_EQ(servers.size(), 2u);
  ClusterOptions options = OptionsFor(servers);
  options.split_min_tokens = 24;
  std::mt19937_64 gen(41);
  const int32_t hq = TestServerOptions().num_qo_heads;
  AttentionOptions every;
  every.logits_soft_cap = 10.f;
  every.sinks.assign(hq, 2.5f);
  AttentionOptions windowed;
  windowed.window_left = 30;
  windowed.sinks = RandomSinks(gen, hq);
  windowed.sinks[0] = 3.f;
  options.kv.attention = every;
  options.kv.layer_attention[1] = windowed;
  for (bool server_plans : {true, false}) {
    options.kv.server_plans = server_plans;
    auto cluster = Cluster::Connect(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    Cluster& c = **cluster;
    Reference ref(c.geometry());
    ref.SetOptions(0, every);
    ref.SetOptions(1, windowed);
    auto step = c.Plan({1, 2}, {60, 5});
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_EQ(c.ShardsOf(1).size(), 2u);
    RunAndCheck(c, ref, **step, gen);
    for (int round = 0; round < 3; ++round) {
      auto decode = c.Plan({1, 2}, {1, 1});
      ASSERT_TRUE(decode.ok()) << decode.status();
      RunAndCheck(c, ref, **decode, gen);
    }
    ASSERT_TRUE(c.Release().ok());
  }
}

// MLA servers (docs/design.md, "Multi-head latent attention"): latent rows
// in k_new alone, a spread sequence's kv_lora_rank-wide states merged by LSE.
TEST(ClusterTest, SpreadSequencesOnMlaServersMatchTheReference) {
  std::vector<TestServerOptions> opts(2);
  for (auto& o : opts) {
    o.kv_lora_rank = 64;
    o.qk_rope_head_dim = 16;
  }
  auto servers = StartServers(opts);
  ASSERT_EQ(servers.size(), 2u);
  ClusterOptions options = OptionsFor(servers);
  options.split_min_tokens = 24;
  auto cluster = Cluster::Connect(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  EXPECT_TRUE(c.geometry().IsMla());
  Reference ref(c.geometry());
  std::mt19937_64 gen(43);
  auto step = c.Plan({1, 2}, {50, 5});
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(c.ShardsOf(1).size(), 2u);
  RunAndCheck(c, ref, **step, gen);
  for (int round = 0; round < 3; ++round) {
    auto decode = c.Plan({1, 2}, {1, 1});
    ASSERT_TRUE(decode.ok()) << decode.status();
    RunAndCheck(c, ref, **decode, gen);
  }
  // A V input is refused before anything is sent.
  auto bad = c.Plan({2}, {1});
  ASSERT_TRUE(bad.ok());
  const KvGeometry& g = c.geometry();
  auto row = RandomHalves(gen, g.dtype, g.RowElems());
  auto q = RandomHalves(gen, g.dtype, g.QRowElems());
  auto refused = c.Run(0, q, row, row, bad->get());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("none in v_new"));
  ASSERT_TRUE(c.Release().ok());
}

INSTANTIATE_TEST_SUITE_P(PageSizesAndServers, ClusterSplitTest,
                         ::testing::Combine(::testing::Values(1, 16), ::testing::Values(2, 3)));

TEST(ClusterTest, ASequenceSpillsToTheNextServerWhenItsServerIsFull) {
  std::vector<TestServerOptions> opts(2);
  opts[0].num_pages = 8;   // 128 tokens
  opts[1].num_pages = 6;   // 96 tokens
  auto servers = StartServers(opts);
  ASSERT_EQ(servers.size(), 2u);
  auto cluster = Cluster::Connect(OptionsFor(servers));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  Reference ref(c.geometry());
  std::mt19937_64 gen(3);
  auto step = c.Plan({5}, {120});  // fits server 0 (8 pages, 120 of 128 tokens)
  ASSERT_TRUE(step.ok()) << step.status();
  RunAndCheck(c, ref, **step, gen);
  auto more = c.Plan({5}, {50});  // 8 more fit on 0, 42 go to 1
  ASSERT_TRUE(more.ok()) << more.status();
  auto shards = c.ShardsOf(5);
  ASSERT_EQ(shards.size(), 2u);
  EXPECT_EQ(shards[0].server, 0);
  EXPECT_EQ(shards[0].length, 128);
  EXPECT_EQ(shards[1].server, 1);
  EXPECT_EQ(shards[1].start, 128);
  EXPECT_EQ(shards[1].length, 42);
  RunAndCheck(c, ref, **more, gen);
  auto decode = c.Plan({5}, {1});
  ASSERT_TRUE(decode.ok());
  RunAndCheck(c, ref, **decode, gen);
  // More than the cluster holds: refused, and nothing changed.
  auto too_much = c.Plan({5, 6}, {1, 200});
  EXPECT_EQ(too_much.status().code(), absl::StatusCode::kResourceExhausted) << too_much.status();
  EXPECT_THAT(too_much.status().message(), HasSubstr("sequence 6"));
  EXPECT_EQ(c.KvLen(5), 171);
  EXPECT_EQ(c.KvLen(6), -1);
  auto again = c.Plan({5}, {1});
  ASSERT_TRUE(again.ok()) << again.status();
  RunAndCheck(c, ref, **again, gen);
  ASSERT_TRUE(c.Release().ok());
}

TEST(ClusterTest, ARestartLosesExactlyThatServersSequences) {
  auto servers = StartServers(std::vector<TestServerOptions>(2));
  ASSERT_EQ(servers.size(), 2u);
  ClusterOptions options = OptionsFor(servers);
  options.split_min_tokens = 40;
  auto cluster = Cluster::Connect(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  Reference ref(c.geometry());
  std::mt19937_64 gen(11);
  // 1 and 2 whole (one per server), 3 spread over both.
  auto step = c.Plan({1, 2, 3}, {20, 20, 50});
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_EQ(c.ShardsOf(3).size(), 2u);
  const int32_t gone = c.ShardsOf(2)[0].server;
  const int64_t keep = c.ShardsOf(1)[0].server == gone ? 2 : 1;
  ASSERT_NE(c.ShardsOf(keep)[0].server, gone);
  const int64_t lose = keep == 1 ? 2 : 1;
  RunAndCheck(c, ref, **step, gen);

  // Restart that server on the same address.
  auto restarted = TestServer::RestartOn(*servers[gone], TestServerOptions{});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  servers[gone] = *std::move(restarted);

  // The next step finds out: lost are the sequences with keys there.
  auto decode = RetryWhileUnavailable([&] { return c.Plan({keep, lose, 3}, {1, 1, 1}); });
  if (decode.ok()) {
    // The plan needed nothing new from the restarted server: its run fails.
    const int64_t n = (*decode)->total_q();
    const KvGeometry& g = c.geometry();
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      auto q = RandomHalves(gen, g.dtype, n * g.num_qo_heads * g.head_dim);
      auto k = RandomHalves(gen, g.dtype, n * g.RowElems());
      auto v = RandomHalves(gen, g.dtype, n * g.RowElems());
      ref.Append(layer, **decode, k, v);
      PrefillResult partial;
      auto out = RetryWhileUnavailable([&] { return c.Run(layer, q, k, v, decode->get(), &partial); });
      ASSERT_EQ(out.status().code(), absl::StatusCode::kDataLoss) << out.status();
      EXPECT_THAT(LostSequences(out.status()), UnorderedElementsAre(lose, 3));
      EXPECT_THAT(out.status().message(), HasSubstr("sequences lost"));
      // The survivor's rows are right.
      const Comparison cmp = ref.Check(layer, **decode, q, partial, {lose, 3});
      EXPECT_TRUE(cmp.Ok(g.dtype)) << cmp.ToString();
    }
  } else {
    // Or the plan did (the restarted server refused it), and nothing changed.
    ASSERT_EQ(decode.status().code(), absl::StatusCode::kDataLoss) << decode.status();
    EXPECT_THAT(LostSequences(decode.status()), UnorderedElementsAre(lose, 3));
  }
  EXPECT_THAT(c.Lost(), UnorderedElementsAre(lose, 3));
  // Planning a lost sequence fails and changes nothing.
  auto refused = c.Plan({keep, 3}, {1, 1});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(LostSequences(refused.status()), ElementsAre(3));
  // Finish the lost ones: their pages on the surviving server go back.
  ASSERT_TRUE(c.Finish({lose, 3}).ok());
  EXPECT_TRUE(c.Lost().empty());
  // The survivor goes on, and new sequences use the restarted server too.
  const int64_t keep_len = c.KvLen(keep);
  auto next = c.Plan({keep, 20, 21}, {1, 30, 30});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(c.KvLen(keep), keep_len + 1);
  RunAndCheck(c, ref, **next, gen);
  bool used_restarted = false;
  for (int64_t id : {20, 21}) used_restarted |= c.ShardsOf(id)[0].server == gone;
  EXPECT_TRUE(used_restarted);
  EXPECT_EQ(c.Servers()[gone].restarts, 1);
  ASSERT_TRUE(c.Release().ok());
  for (const auto& s : c.Servers()) EXPECT_EQ(s.pages_held, 0);
}

// A step of other sequences that needs a server found restarted now is
// planned at once (docs/cluster.md, "When a call fails"): the sequences the
// restart lost are reported when a call names them.
TEST(ClusterTest, AStepOfOtherSequencesIsPlannedAtOnceOnARestartedServer) {
  auto servers = StartServers(std::vector<TestServerOptions>(1));
  ASSERT_EQ(servers.size(), 1u);
  auto cluster = Cluster::Connect(OptionsFor(servers));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  ASSERT_TRUE(c.Plan({1}, {16}).ok());
  auto restarted = TestServer::RestartOn(*servers[0], TestServerOptions{});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  servers[0] = *std::move(restarted);
  auto step = RetryWhileUnavailable([&] { return c.Plan({5}, {4}); });
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(c.KvLen(5), 4);
  EXPECT_THAT(c.Lost(), ElementsAre(1));
  auto refused = c.Plan({1}, {1});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_THAT(LostSequences(refused.status()), ElementsAre(1));
  Reference ref(c.geometry());
  std::mt19937_64 gen(12);
  RunAndCheck(c, ref, **step, gen);
  ASSERT_TRUE(c.Finish({1, 5}).ok());
  ASSERT_TRUE(c.Release().ok());
}

// A step runs only on the cluster that planned it: another cluster's step
// may carry a step number live here, and names its own servers (before, a
// step of a two-server cluster run on a one-server cluster read past its
// servers and crashed).
TEST(ClusterTest, AnotherClustersStepIsRefused) {
  auto servers = StartServers(std::vector<TestServerOptions>(2));
  ASSERT_EQ(servers.size(), 2u);
  ClusterOptions both = OptionsFor(servers);
  both.split_min_tokens = 2;
  ClusterOptions one = OptionsFor(servers);
  one.targets.resize(1);
  auto y = Cluster::Connect(both);
  auto x = Cluster::Connect(one);
  ASSERT_TRUE(x.ok() && y.ok());
  auto mine = (*x)->Plan({1}, {4});
  auto theirs = (*y)->Plan({2}, {8});
  ASSERT_TRUE(mine.ok() && theirs.ok());
  ASSERT_EQ((*theirs)->parts.size(), 2u);
  const KvGeometry& g = (*x)->geometry();
  std::mt19937_64 gen(13);
  const auto q = RandomHalves(gen, g.dtype, 8 * g.num_qo_heads * g.head_dim);
  const auto kv = RandomHalves(gen, g.dtype, 8 * g.RowElems());
  auto refused = (*x)->Run(0, q, kv, kv, theirs->get());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("was planned by another Cluster"));
  Reference ref(g);
  RunAndCheck(**x, ref, **mine, gen);
  ASSERT_TRUE((*x)->Release().ok());
  ASSERT_TRUE((*y)->Release().ok());
}

TEST(ClusterTest, RefreshSeesARestartBeforeAnyCall) {
  auto servers = StartServers(std::vector<TestServerOptions>(2));
  ASSERT_EQ(servers.size(), 2u);
  auto cluster = Cluster::Connect(OptionsFor(servers));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  ASSERT_TRUE(c.Plan({1, 2}, {16, 16}).ok());
  const int32_t gone = c.ShardsOf(1)[0].server;
  auto restarted = TestServer::RestartOn(*servers[gone], TestServerOptions{});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  absl::Status s = RefreshUntilItSaysMore(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(LostSequences(s), ElementsAre(1));
  EXPECT_THAT(c.Sequences(), ElementsAre(2));
  ASSERT_TRUE(c.Finish({1}).ok());
  ASSERT_TRUE(c.Release().ok());
}

// A server back with another geometry loses its sequences, as any restart,
// and leaves the cluster: its client and KV manager lay out requests for the
// geometry they connected to. The rest keep serving.
TEST(ClusterTest, AServerBackWithAnotherGeometryLeavesTheCluster) {
  auto servers = StartServers(std::vector<TestServerOptions>(2));
  ASSERT_EQ(servers.size(), 2u);
  auto cluster = Cluster::Connect(OptionsFor(servers));
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  ASSERT_TRUE(c.Plan({1, 2}, {16, 16}).ok());
  const int32_t gone = c.ShardsOf(1)[0].server;
  ASSERT_NE(c.ShardsOf(2)[0].server, gone);
  TestServerOptions again;
  again.page_size = 8;
  auto restarted = TestServer::RestartOn(*servers[gone], again);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  absl::Status s = RefreshUntilItSaysMore(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(LostSequences(s), ElementsAre(1));
  EXPECT_FALSE(c.Servers()[gone].active);
  ASSERT_TRUE(c.Finish({1}).ok());
  // New sequences go to the other server only, and the cluster keeps working.
  ASSERT_TRUE(c.Plan({3}, {16}).ok());
  EXPECT_NE(c.ShardsOf(3)[0].server, gone);
  ASSERT_TRUE(c.Refresh().ok());
  ASSERT_TRUE(c.Finish({2, 3}).ok());
  ASSERT_TRUE(c.Release().ok());
}

TEST(ClusterTest, RefusesServersWithAnotherGeometry) {
  std::vector<TestServerOptions> opts(2);
  opts[1].page_size = 8;
  opts[1].num_pages = 512;
  auto servers = StartServers(opts);
  ASSERT_EQ(servers.size(), 2u);
  auto cluster = Cluster::Connect(OptionsFor(servers));
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(cluster.status().message(), HasSubstr(servers[1]->grpc_address()));
  EXPECT_THAT(cluster.status().message(), HasSubstr("page_size=8 (the others have 16)"));
  // num_pages may differ (GPUs of different sizes).
  std::vector<TestServerOptions> ok_opts(2);
  ok_opts[1].num_pages = 100;
  auto ok_servers = StartServers(ok_opts);
  ASSERT_EQ(ok_servers.size(), 2u);
  EXPECT_TRUE(Cluster::Connect(OptionsFor(ok_servers)).ok());
}

TEST(ClusterTest, BadOptionsAndArgumentsAreRefused) {
  ClusterOptions none;
  EXPECT_EQ(Cluster::Connect(none).status().code(), absl::StatusCode::kInvalidArgument);
  ClusterOptions bad_dns;
  bad_dns.targets = {"dns:///no-port"};
  EXPECT_THAT(Cluster::Connect(bad_dns).status().message(), HasSubstr("dns:///NAME:PORT"));
  auto servers = StartServers(std::vector<TestServerOptions>(1));
  ASSERT_EQ(servers.size(), 1u);
  auto cluster = Cluster::Connect(OptionsFor(servers));
  ASSERT_TRUE(cluster.ok());
  Cluster& c = **cluster;
  EXPECT_EQ(c.Plan({}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Plan({1, 1}, {1, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Plan({1}, {-1}).status().code(), absl::StatusCode::kInvalidArgument);
  auto step = c.Plan({1}, {3});
  ASSERT_TRUE(step.ok());
  std::vector<uint16_t> q(2), k(2), v(2);
  EXPECT_EQ(c.Run(0, q, k, v).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.Finish({99}).code(), absl::StatusCode::kNotFound);
  // A later plan of the same sequence makes the step stale.
  ASSERT_TRUE(c.Plan({1}, {1}).ok());
  const KvGeometry& g = c.geometry();
  std::vector<uint16_t> q3(3 * g.num_qo_heads * g.head_dim), k3(3 * g.RowElems()),
      v3(3 * g.RowElems());
  EXPECT_EQ(c.Run(0, q3, k3, v3, step->get()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c.Release().ok());
}

TEST(ClusterTest, DiscoversServersThroughDnsAndReResolves) {
  auto servers = StartServers(std::vector<TestServerOptions>(2));
  ASSERT_EQ(servers.size(), 2u);
  // getaddrinfo of a numeric name: one server.
  const std::string a0 = servers[0]->grpc_address();
  const std::string port0 = a0.substr(a0.rfind(':') + 1);
  ClusterOptions real;
  real.targets = {absl::StrCat("dns:///127.0.0.1:", port0)};
  auto one = Cluster::Connect(real);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ((*one)->num_servers(), 1);
  EXPECT_EQ((*one)->Servers()[0].address, a0);

  // A name whose answer changes (a headless Service as pods come and go).
  std::vector<std::string> answer = {servers[0]->grpc_address()};
  ClusterOptions options;
  options.targets = {"dns:///attnserve-pods.test:50051"};
  options.refresh_interval_s = 0;  // every Plan() refreshes
  options.resolver = [&](const std::string& host, const std::string& port)
      -> absl::StatusOr<std::vector<std::string>> {
    EXPECT_EQ(host, "attnserve-pods.test");
    EXPECT_EQ(port, "50051");
    return answer;
  };
  auto cluster = Cluster::Connect(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  ASSERT_EQ(c.num_servers(), 1);
  ASSERT_TRUE(c.Plan({1}, {16}).ok());
  answer.push_back(servers[1]->grpc_address());
  ASSERT_TRUE(c.Plan({2}, {16}).ok());  // joins at the Plan's refresh
  ASSERT_EQ(c.num_servers(), 2);
  EXPECT_EQ(c.ShardsOf(2)[0].server, 1);  // the new, emptier server
  // Server 1 leaves the name and stops: its sequences are lost.
  answer.pop_back();
  ASSERT_EQ(servers[1]->Stop(), 0);
  absl::Status s = c.Refresh();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(LostSequences(s), ElementsAre(2));
  EXPECT_FALSE(c.Servers()[1].active);
  ASSERT_TRUE(c.Finish({2}).ok());
  ASSERT_TRUE(c.Plan({3}, {16}).ok());
  EXPECT_EQ(c.ShardsOf(3)[0].server, 0);
  ASSERT_TRUE(c.Release().ok());
}

}  // namespace
}  // namespace attnserve
