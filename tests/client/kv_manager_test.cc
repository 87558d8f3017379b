// KvManager (client/kv_manager.h) against the real attnserve binary (CPU
// backend) on a free port: many steps with sequences starting, decoding and
// finishing, each layer checked against the float64 reference of
// client/workload.h over the test's own mirror of every appended row; pages
// back to the start count; atomic plans; stale plans; a server restart.
#include "client/kv_manager.h"

#include <algorithm>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Client> Connect(const TestServer& server) {
  ClientOptions options;
  options.target = server.grpc_address();
  options.timeout_s = 120;
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

int32_t FreePages(Client& client) {
  auto info = client.GetServerInfo();
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->free_pages() : -1;
}

// The plan against docs/kv_manager.md, given each sequence's length before.
void ExpectLayout(const KvManager& mgr, const StepPlan& plan,
                  const std::vector<int64_t>& before) {
  const int32_t ps = mgr.page_size();
  for (size_t b = 0; b < plan.seq_ids.size(); ++b) {
    const int64_t id = plan.seq_ids[b];
    const int64_t len = mgr.KvLen(id);
    ASSERT_EQ(len, before[b] + plan.q_lens[b]);
    EXPECT_EQ(plan.kv_lens[b], len);
    const std::vector<int32_t> pages = mgr.PagesOf(id);
    EXPECT_EQ(static_cast<int64_t>(pages.size()), (len + ps - 1) / ps);
    EXPECT_EQ(std::vector<int32_t>(plan.kv_indices.begin() + plan.kv_indptr[b],
                                   plan.kv_indices.begin() + plan.kv_indptr[b + 1]),
              pages);
    EXPECT_EQ(plan.kv_last_page_len[b],
              pages.empty() ? 0 : len - (static_cast<int64_t>(pages.size()) - 1) * ps);
    for (int32_t i = 0; i < plan.q_lens[b]; ++i) {
      const int64_t row = plan.qo_indptr[b] + i, pos = before[b] + i;
      EXPECT_EQ(plan.positions[row], pos);
      EXPECT_EQ(plan.append_slots[row], int64_t{pages[pos / ps]} * ps + pos % ps);
    }
  }
}

// With server plans (CreatePlan, the default) and with the layout sent with
// every layer.
class KvManagerStepsTest : public ::testing::TestWithParam<bool> {};

// Many steps on a server started with `options`: sequences start, decode and
// finish; every layer is checked against the reference.
void RunManySteps(const TestServerOptions& options, bool server_plans) {
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  const int32_t start_free = FreePages(*client);
  KvManagerOptions manager_options;
  manager_options.server_plans = server_plans;
  KvManager mgr(client.get(), manager_options);
  KvMirror mirror(g);
  std::mt19937_64 gen(30);
  std::vector<int64_t> active;
  int64_t next_id = 100, layers_checked = 0, finished = 0, longest = 0;
  for (int step = 0; step < 30; ++step) {
    const int starts = active.size() < 6 ? static_cast<int>(gen() % 3) : 0;
    for (int i = 0; i < starts; ++i) active.push_back(next_id++);
    if (step % 4 == 3 && !active.empty()) {
      std::vector<int64_t> done, kept;
      for (int64_t id : active) {
        (mgr.KvLen(id) >= 0 && gen() % 5 < 2 ? done : kept).push_back(id);
      }
      if (!done.empty()) {
        absl::Status s = mgr.Finish(done);
        ASSERT_TRUE(s.ok()) << s;
        finished += static_cast<int64_t>(done.size());
        for (int64_t id : done) EXPECT_EQ(mgr.KvLen(id), -1);
      }
      active = kept;
    }
    if (active.empty()) continue;
    std::vector<int32_t> q_lens;
    std::vector<int64_t> before;
    for (int64_t id : active) {
      const bool known = mgr.KvLen(id) >= 0;
      q_lens.push_back(known ? (gen() % 4 == 0 ? 3 : 1) : 5 + static_cast<int32_t>(gen() % 35));
      before.push_back(known ? mgr.KvLen(id) : 0);
    }
    auto plan = mgr.Plan(active, q_lens);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectLayout(mgr, **plan, before);
    EXPECT_EQ((*plan)->plan_id != 0, server_plans);
    EXPECT_EQ(FreePages(*client), start_free - mgr.NumPages());
    const int64_t total_q = (*plan)->total_q();
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      const std::vector<uint16_t> q = RandomHalves(gen, g.dtype, total_q * g.num_qo_heads * g.head_dim);
      const std::vector<uint16_t> k = RandomHalves(gen, g.dtype, total_q * g.RowElems());
      // MLA: the latent rows in k, no v.
      const std::vector<uint16_t> v =
          RandomHalves(gen, g.dtype, g.HasVPool() ? total_q * g.RowElems() : 0);
      auto out = mgr.Run(layer, q, k, v);
      ASSERT_TRUE(out.ok()) << out.status();
      mirror.Write(layer, (*plan)->append_slots, k, v);
      PrefillInputs in;
      in.layer = layer;
      in.q = q;
      in.qo_indptr = (*plan)->qo_indptr;
      in.kv_indptr = (*plan)->kv_indptr;
      in.kv_indices = (*plan)->kv_indices;
      in.kv_last_page_len = (*plan)->kv_last_page_len;
      std::vector<double> o_ref, lse_ref;
      ReferencePrefill(mirror, in, &o_ref, &lse_ref);
      const Comparison c = Compare(g.dtype, o_ref, lse_ref, out->o, out->lse);
      EXPECT_TRUE(c.Ok(g.dtype)) << "step " << step << " layer " << layer << ": " << c.ToString();
      ++layers_checked;
    }
    for (int64_t id : active) longest = std::max(longest, mgr.KvLen(id));
  }
  EXPECT_GE(layers_checked, 40);
  EXPECT_GE(finished, 3);
  EXPECT_GT(longest, 2 * g.page_size);  // sequences crossed pages
  ASSERT_TRUE(mgr.Release().ok());
  EXPECT_EQ(mgr.NumPages(), 0);
  EXPECT_TRUE(mgr.Sequences().empty());
  EXPECT_EQ(FreePages(*client), start_free);  // plans released, pages freed
}

TEST_P(KvManagerStepsTest, ManyStepsWithSequencesFinishingAndStarting) {
  RunManySteps(TestServerOptions{}, GetParam());  // 2 layers, 256 pages of 16, 8 / 2 heads of 64
}

// The same on an MLA server: k_new holds the latent rows, v_new is empty.
TEST_P(KvManagerStepsTest, ManyStepsOnAnMlaServer) {
  TestServerOptions options;
  options.kv_lora_rank = 64;
  options.qk_rope_head_dim = 16;
  RunManySteps(options, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Plans, KvManagerStepsTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "ServerPlans" : "Layout"; });

// Attention options per manager and per layer (docs/design.md, "Variants"):
// a soft-cap and sinks on every layer, a window and other sinks instead on
// layer 0; with server plans they travel in each step's plan, without in
// each layer's Prefill. Checked against the float64 reference.
TEST_P(KvManagerStepsTest, AttentionOptionsPerLayer) {
  TestServerOptions options;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  std::mt19937_64 gen(31);
  KvManagerOptions manager_options;
  manager_options.server_plans = GetParam();
  manager_options.attention.logits_soft_cap = 8.f;
  manager_options.attention.sinks = RandomSinks(gen, g.num_qo_heads);
  AttentionOptions windowed;
  windowed.window_left = 6;
  windowed.sinks.assign(g.num_qo_heads, 2.f);
  manager_options.layer_attention[0] = windowed;
  KvManager mgr(client.get(), manager_options);
  KvMirror mirror(g);
  for (const std::vector<int32_t>& q_lens :
       std::vector<std::vector<int32_t>>{{20, 3}, {1, 1}, {4, 1}, {1, 1}}) {
    auto plan = mgr.Plan({7, 9}, q_lens);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ((*plan)->plan_id != 0, GetParam());
    const int64_t total_q = (*plan)->total_q();
    for (int32_t layer = 0; layer < g.num_layers; ++layer) {
      const auto q = RandomHalves(gen, g.dtype, total_q * g.num_qo_heads * g.head_dim);
      const auto k = RandomHalves(gen, g.dtype, total_q * g.RowElems());
      const auto v = RandomHalves(gen, g.dtype, total_q * g.RowElems());
      auto out = mgr.Run(layer, q, k, v);
      ASSERT_TRUE(out.ok()) << out.status();
      mirror.Write(layer, (*plan)->append_slots, k, v);
      PrefillInputs in;
      in.layer = layer;
      in.q = q;
      in.qo_indptr = (*plan)->qo_indptr;
      in.kv_indptr = (*plan)->kv_indptr;
      in.kv_indices = (*plan)->kv_indices;
      in.kv_last_page_len = (*plan)->kv_last_page_len;
      in.options = layer == 0 ? windowed : manager_options.attention;
      std::vector<double> o_ref, lse_ref;
      ReferencePrefill(mirror, in, &o_ref, &lse_ref);
      const Comparison c = Compare(g.dtype, o_ref, lse_ref, out->o, out->lse);
      EXPECT_TRUE(c.Ok(g.dtype)) << "layer " << layer << ": " << c.ToString();
    }
  }
  ASSERT_TRUE(mgr.Release().ok());
}

TEST(KvManagerTest, PlanIsAtomicWhenPagesRunOut) {
  TestServerOptions options;
  options.num_layers = 1;
  options.num_pages = 6;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  KvManager mgr(client.get());
  ASSERT_TRUE(mgr.Plan({1, 2}, {20, 30}).ok());  // 2 + 2 pages
  EXPECT_EQ(FreePages(*client), 2);
  auto over = mgr.Plan({1, 2, 3}, {16, 16, 1});  // 1 + 1 + 1 more
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_EQ(mgr.KvLen(1), 20);
  EXPECT_EQ(mgr.KvLen(2), 30);
  EXPECT_EQ(mgr.KvLen(3), -1);
  EXPECT_EQ(mgr.NumPages(), 4);
  EXPECT_EQ(FreePages(*client), 2);
  auto fits = mgr.Plan({1, 2}, {1, 1});  // inside the held pages
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ((*fits)->kv_lens, (std::vector<int32_t>{21, 31}));
  ASSERT_TRUE(mgr.Finish({1}).ok());
  EXPECT_EQ(FreePages(*client), 4);
  ASSERT_TRUE(mgr.Release().ok());
  EXPECT_EQ(FreePages(*client), 6);
}

TEST(KvManagerTest, PlanIsAtomicWhenTheServerRefusesThePlan) {
  TestServerOptions options;
  options.num_layers = 1;
  options.num_pages = 16;
  options.extra_flags = {"--max_plans_per_tenant=2"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  KvManager mgr(client.get());
  ASSERT_TRUE(mgr.Plan({1}, {20}).ok());  // live plans: 1
  ASSERT_TRUE(mgr.Plan({2}, {3}).ok());   // live plans: 2
  const int32_t free = FreePages(*client);
  auto over = mgr.Plan({3}, {40});        // a third: over the cap
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_EQ(mgr.KvLen(3), -1);
  EXPECT_EQ(FreePages(*client), free);    // its 3 new pages went back
  ASSERT_TRUE(mgr.Finish({2}).ok());      // releases 2's plan
  auto fits = mgr.Plan({3}, {40});
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_NE((*fits)->plan_id, 0u);
  ASSERT_TRUE(mgr.Release().ok());
  EXPECT_EQ(FreePages(*client), 16);
}

TEST(KvManagerTest, StalePlansBadArgumentsAndMicroBatches) {
  TestServerOptions options;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  KvManager mgr(client.get());
  std::mt19937_64 gen(31);
  const std::vector<uint16_t> q = RandomHalves(gen, g.dtype, g.num_qo_heads * g.head_dim);
  const std::vector<uint16_t> kv = RandomHalves(gen, g.dtype, g.RowElems());
  EXPECT_EQ(mgr.Run(0, q, kv, kv).status().code(), absl::StatusCode::kFailedPrecondition);
  auto a = mgr.Plan({1}, {1});
  auto b = mgr.Plan({2}, {1});  // disjoint: both may run
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(mgr.Run(0, q, kv, kv, a->get()).ok());
  EXPECT_TRUE(mgr.Run(0, q, kv, kv, b->get()).ok());
  auto a2 = mgr.Plan({1}, {1});
  ASSERT_TRUE(a2.ok());
  auto stale = mgr.Run(0, q, kv, kv, a->get());
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stale.status().message(), HasSubstr("stale"));
  ASSERT_TRUE(mgr.Finish({2}).ok());
  EXPECT_THAT(mgr.Run(0, q, kv, kv, b->get()).status().message(), HasSubstr("stale"));
  EXPECT_EQ(mgr.Finish({2}).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(mgr.Finish({1, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(mgr.Plan({}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mgr.Plan({1, 1}, {1, 1}).status().message(), HasSubstr("twice"));
  EXPECT_THAT(mgr.Plan({1}, {1, 2}).status().message(), HasSubstr("1 seq_ids but 2 q_lens"));
  EXPECT_THAT(mgr.Plan({1}, {-1}).status().message(), HasSubstr("q_lens[0]=-1"));
  EXPECT_EQ(mgr.KvLen(1), 2);
  // The server's checks still apply: rows that do not match the slots.
  ASSERT_TRUE(mgr.Plan({1}, {2}).ok());
  const std::vector<uint16_t> q2 = RandomHalves(gen, g.dtype, 2 * g.num_qo_heads * g.head_dim);
  auto wrong = mgr.Run(0, q2, kv, kv);  // 1 K/V row for 2 slots
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("append_k"));
  ASSERT_TRUE(mgr.Release().ok());
}

// A plan runs only on the manager that made it: another manager's plan may
// carry a step number live here (both count 1, 2, ...), and would write and
// read the other manager's pages (without leases and server plans nothing on
// the server tells them apart).
TEST(KvManagerTest, AnotherManagersPlanIsRefusedAndChangesNothing) {
  TestServerOptions options;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  KvManagerOptions plain;
  plain.lease = false;
  plain.server_plans = false;
  KvManager a(client.get(), plain), b(client.get(), plain);
  std::mt19937_64 gen(32);
  const std::vector<uint16_t> q = RandomHalves(gen, g.dtype, g.num_qo_heads * g.head_dim);
  const std::vector<uint16_t> kv = RandomHalves(gen, g.dtype, g.RowElems());
  ASSERT_TRUE(a.Plan({1}, {1}).ok());
  auto theirs = b.Plan({2}, {1});
  ASSERT_TRUE(theirs.ok());
  ASSERT_EQ((*theirs)->step, 1);
  auto refused = a.Run(0, q, kv, kv, theirs->get());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("was made by another KvManager"));
  EXPECT_THAT(a.Sequences(), ::testing::ElementsAre(1));
  EXPECT_TRUE(a.CheckWritten({2}).ok());
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    EXPECT_TRUE(a.Run(layer, q, kv, kv).ok());
    EXPECT_TRUE(b.Run(layer, q, kv, kv).ok());
  }
  ASSERT_TRUE(a.Release().ok());
  ASSERT_TRUE(b.Release().ok());
}

TEST(KvManagerTest, ServerRestartGivesFailedPrecondition) {
  TestServerOptions options;
  options.num_pages = 16;
  auto first = TestServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->grpc_address();
  auto client = Connect(**first);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  KvManager mgr(client.get());
  ASSERT_TRUE(mgr.Plan({1}, {5}).ok());
  EXPECT_EQ((*first)->Stop(), 0);
  options.extra_flags = {absl::StrCat("--listen=", address)};
  auto second = TestServer::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ((*second)->grpc_address(), address);
  std::mt19937_64 gen(32);
  const std::vector<uint16_t> q = RandomHalves(gen, g.dtype, 5 * g.num_qo_heads * g.head_dim);
  const std::vector<uint16_t> kv = RandomHalves(gen, g.dtype, 5 * g.RowElems());
  auto out = mgr.Run(0, q, kv, kv);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition) << out.status();
  EXPECT_THAT(out.status().message(), HasSubstr("incarnation"));
  // Allocation is caught too (by the server, or from the response's incarnation).
  EXPECT_EQ(mgr.Plan({1}, {16}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(mgr.KvLen(1), 5);
}

}  // namespace
}  // namespace attnserve
