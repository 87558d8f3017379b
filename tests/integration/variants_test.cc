// Attention variants through the whole server (docs/design.md, "Variants"):
// batches that mix sequences of different windows, soft-caps and sinks;
// plans carrying options for every layer and per layer, with Prefills that
// fill in what a plan leaves unset and are refused when they contradict it;
// a sequence spread over two servers whose sinks enter exactly one range;
// and every bad value refused with INVALID_ARGUMENT naming the field. All
// against the float64 reference, on random data.
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <thread>
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

constexpr float kInf = std::numeric_limits<float>::infinity();

std::unique_ptr<Client> Connect(const TestServer& server) {
  ClientOptions options;
  options.target = server.grpc_address();
  options.timeout_s = 60;
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// Random K/V into every slot of `pages` in `layer`, mirrored.
void Fill(Client& client, KvMirror& mirror, absl::Span<const int32_t> pages, int32_t layer,
          std::mt19937_64& gen) {
  const KvGeometry& g = mirror.geometry();
  const std::vector<int64_t> slots = SlotsOfPages(g, pages);
  const int64_t n = static_cast<int64_t>(slots.size()) * g.RowElems();
  const auto k = RandomHalves(gen, g.dtype, n), v = RandomHalves(gen, g.dtype, n);
  ASSERT_TRUE(client.WriteKV(layer, slots, k, v).ok());
  mirror.Write(layer, slots, k, v);
}

void ExpectMatches(const KvMirror& mirror, const PrefillInputs& in, const PrefillResult& out,
                   const std::string& what) {
  std::vector<double> o_ref, lse_ref;
  ReferencePrefill(mirror, in, &o_ref, &lse_ref);
  const Comparison c = Compare(mirror.geometry().dtype, o_ref, lse_ref, out.o, out.lse);
  EXPECT_TRUE(c.Ok(mirror.geometry().dtype)) << what << ": " << c.ToString();
}

// Requests with random options (RandomOptions), sent from several threads at
// once so that the scheduler batches them together, each against its own
// reference; some with apply_sinks keeping the sinks out of some sequences.
TEST(VariantsTest, MixedBatchesMatchTheReference) {
  TestServerOptions options;
  options.extra_flags = {"--max_queue_delay_us=20000"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto setup = Connect(**server);
  ASSERT_TRUE(setup);
  const KvGeometry g = GeometryOf(setup->info());
  std::mt19937_64 gen(7);
  WorkloadSpec spec;
  spec.batch = 3;
  spec.max_q_len = 24;
  spec.max_kv_len = 160;
  spec.variants = true;
  constexpr int kThreads = 4, kRounds = 3;
  auto pages = setup->AllocatePages(static_cast<int32_t>(PagesNeeded(g, spec) * kThreads));
  ASSERT_TRUE(pages.ok()) << pages.status();
  KvMirror mirror(g);
  for (int32_t layer = 0; layer < g.num_layers; ++layer) Fill(*setup, mirror, *pages, layer, gen);
  const int64_t per_thread = PagesNeeded(g, spec);
  std::vector<std::vector<PrefillInputs>> work(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    const absl::Span<const int32_t> mine =
        absl::MakeConstSpan(*pages).subspan(t * per_thread, per_thread);
    for (int r = 0; r < kRounds; ++r) {
      spec.layer = (t + r) % g.num_layers;
      spec.causal = (t + r) % 3 != 0;
      PrefillInputs in = RandomPrefill(gen, g, spec, mine);
      if (r == 1) in.kv_keys_after = {0, 9, 40};
      if (!in.options.sinks.empty() && r == 2) in.apply_sinks = {1, 0, 1};
      work[t].push_back(std::move(in));
    }
  }
  std::vector<std::vector<absl::StatusOr<PrefillResult>>> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto client = Connect(**server);
      for (const PrefillInputs& in : work[t]) results[t].push_back(client->Prefill(ArgsOf(in)));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    for (int r = 0; r < kRounds; ++r) {
      ASSERT_TRUE(results[t][r].ok()) << results[t][r].status();
      ExpectMatches(mirror, work[t][r], *results[t][r], absl::StrCat("thread ", t, " round ", r));
    }
  }
}

// A plan with options for every layer and per layer: each layer's Prefill
// runs with its layer's, may add what they leave unset, and is refused
// naming the field when it sets one differently.
TEST(VariantsTest, PlansCarryOptionsPerLayer) {
  TestServerOptions options;
  options.num_layers = 3;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_TRUE(client);
  const KvGeometry g = GeometryOf(client->info());
  std::mt19937_64 gen(8);
  WorkloadSpec spec;
  spec.batch = 4;
  spec.max_q_len = 20;
  spec.max_kv_len = 150;
  auto pages = client->AllocatePages(static_cast<int32_t>(PagesNeeded(g, spec)));
  ASSERT_TRUE(pages.ok()) << pages.status();
  KvMirror mirror(g);
  for (int32_t layer = 0; layer < g.num_layers; ++layer) Fill(*client, mirror, *pages, layer, gen);
  PrefillInputs in = RandomPrefill(gen, g, spec, *pages);
  in.kv_keys_after = {0, 5, 0, 12};
  in.apply_sinks = {1, 1, 0, 1};
  // Every layer: a soft-cap. Layer 1: a window and sinks instead (its entry
  // replaces the plan's options whole). Layer 2: a window only.
  AttentionOptions all;
  all.logits_soft_cap = 5.f;
  AttentionOptions windowed;
  windowed.window_left = 16;
  windowed.sinks = RandomSinks(gen, g.num_qo_heads);
  windowed.sinks[0] = 1.5f;  // at least one head has a sink
  AttentionOptions window_only;
  window_only.window_left = 3;
  PlanLayout layout{in.qo_indptr, in.kv_indptr, in.kv_indices, in.kv_last_page_len, {},
                    in.kv_keys_after, in.apply_sinks, all, {{1, windowed}, {2, window_only}}};
  auto plan = client->CreatePlan(layout);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::map<int32_t, AttentionOptions> want = {{0, all}, {1, windowed}, {2, window_only}};
  for (const auto& [layer, o] : want) {
    PrefillInputs expected = in;
    expected.layer = layer;
    expected.options = o;
    PrefillArgs args;
    args.layer = layer;
    args.q = in.q;
    args.plan_id = *plan;
    auto out = client->Prefill(args);
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectMatches(mirror, expected, *out, absl::StrCat("plan, layer ", layer));
  }
  // Layer 2 leaves the soft-cap and the sinks unset: the Prefill adds them.
  {
    PrefillInputs expected = in;
    expected.layer = 2;
    expected.options = window_only;
    expected.options.logits_soft_cap = 30.f;
    expected.options.sinks.assign(g.num_qo_heads, 0.5f);
    PrefillArgs args;
    args.layer = 2;
    args.q = in.q;
    args.plan_id = *plan;
    args.options.logits_soft_cap = 30.f;
    args.options.sinks = expected.options.sinks;
    args.options.window_left = 3;  // agrees with the plan
    auto out = client->Prefill(args);
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectMatches(mirror, expected, *out, "plan and Prefill together, layer 2");
  }
  // Contradictions, each named.
  struct Case {
    int32_t layer;
    AttentionOptions options;
    std::string message;
  };
  AttentionOptions wider, no_cap, other_sinks;
  wider.window_left = 17;
  no_cap.logits_soft_cap = 0.f;
  other_sinks.sinks = windowed.sinks;
  other_sinks.sinks[0] = 2.f;
  const Case cases[] = {
      {1, wider, "options.window_left=17 contradicts the plan's window_left=16 for layer 1"},
      {0, no_cap, "options.logits_soft_cap=0 contradicts the plan's logits_soft_cap=5 for layer 0"},
      {1, other_sinks, "options.sinks[0]=2 contradicts the plan's sinks[0]=1.5 for layer 1"},
  };
  for (const Case& c : cases) {
    PrefillArgs args;
    args.layer = c.layer;
    args.q = in.q;
    args.plan_id = *plan;
    args.options = c.options;
    auto out = client->Prefill(args);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    EXPECT_THAT(std::string(out.status().message()), HasSubstr(c.message));
  }
  // The plan holds apply_sinks: a Prefill naming it may not bring its own.
  PrefillArgs args;
  args.layer = 0;
  args.q = in.q;
  args.plan_id = *plan;
  args.apply_sinks = in.apply_sinks;
  EXPECT_THAT(std::string(client->Prefill(args).status().message()), HasSubstr("apply_sinks"));
  ASSERT_TRUE(client->ReleasePlan(*plan).ok());
}

// A sequence spread over two servers (context parallelism): its sinks enter
// the range holding its first keys only, so the merge by LSE of the two
// states is the whole sequence's attention; sinks on both, or on neither,
// fail the same comparison.
TEST(VariantsTest, SpreadSequenceTakesItsSinksOnce) {
  TestServerOptions options;
  auto a = TestServer::Start(options);
  auto b = TestServer::Start(options);
  ASSERT_TRUE(a.ok() && b.ok());
  auto ca = Connect(**a), cb = Connect(**b);
  ASSERT_TRUE(ca && cb);
  const KvGeometry g = GeometryOf(ca->info());
  std::mt19937_64 gen(9);
  const int32_t total = 100, split = 53, q_len = 40;
  auto pa = ca->AllocatePages(4), pb = cb->AllocatePages(3);
  ASSERT_TRUE(pa.ok() && pb.ok());
  KvMirror ma(g), mb(g);
  Fill(*ca, ma, *pa, 0, gen);
  Fill(*cb, mb, *pb, 0, gen);
  AttentionOptions o;
  o.window_left = 60;
  o.logits_soft_cap = 8.f;
  o.sinks.resize(g.num_qo_heads);
  std::normal_distribution<float> dist(1.f, 0.5f);
  for (float& x : o.sinks) x = dist(gen);
  const auto q = RandomHalves(gen, g.dtype, int64_t{q_len} * g.num_qo_heads * g.head_dim);
  auto range = [&](const std::vector<int32_t>& pages, int32_t len, int32_t after, bool sinks) {
    PrefillInputs in;
    in.q = q;
    in.qo_indptr = {0, q_len};
    in.kv_indptr = {0, static_cast<int32_t>((len + g.page_size - 1) / g.page_size)};
    in.kv_indices.assign(pages.begin(), pages.begin() + in.kv_indptr[1]);
    in.kv_last_page_len = {len - (in.kv_indptr[1] - 1) * g.page_size};
    in.kv_keys_after = {after};
    in.options = o;
    in.apply_sinks = {static_cast<uint8_t>(sinks ? 1 : 0)};
    return in;
  };
  // The reference: the whole sequence on one (virtual) server, page_size 1.
  KvGeometry whole_geo = g;
  whole_geo.page_size = 1;
  whole_geo.num_pages = total;
  KvMirror whole(whole_geo);
  PrefillInputs in;
  in.q = q;
  in.qo_indptr = {0, q_len};
  in.kv_indptr = {0, total};
  in.options = o;
  for (int32_t p = 0; p < total; ++p) {
    const bool on_a = p < split;
    const int64_t local = on_a ? p : p - split;
    const std::vector<int32_t>& pages = on_a ? *pa : *pb;
    const int64_t slot = int64_t{pages[local / g.page_size]} * g.page_size + local % g.page_size;
    const KvMirror& m = on_a ? ma : mb;
    const int64_t slots[] = {p};
    whole.Write(0, slots, absl::MakeConstSpan(m.K(0, slot), g.RowElems()),
                absl::MakeConstSpan(m.V(0, slot), g.RowElems()));
    in.kv_indices.push_back(p);
  }
  std::vector<double> o_ref, lse_ref;
  ReferencePrefill(whole, in, &o_ref, &lse_ref);
  for (int variant = 0; variant < 3; ++variant) {  // sinks on a only; on both; on neither
    const bool on_a = variant != 2, on_b = variant == 1;
    auto oa = ca->Prefill(ArgsOf(range(*pa, split, total - split, on_a)));
    auto ob = cb->Prefill(ArgsOf(range(*pb, total - split, 0, on_b)));
    ASSERT_TRUE(oa.ok() && ob.ok()) << oa.status() << ob.status();
    const State states[] = {{oa->o, oa->lse}, {ob->o, ob->lse}};
    auto merged = ca->MergeStates(states, q_len, g.num_qo_heads, g.head_dim, false);
    ASSERT_TRUE(merged.ok()) << merged.status();
    const Comparison c = Compare(g.dtype, o_ref, lse_ref, merged->v, merged->lse);
    EXPECT_EQ(c.Ok(g.dtype), variant == 0)
        << (variant == 0 ? "sinks once" : variant == 1 ? "sinks twice" : "no sinks") << ": "
        << c.ToString();
  }
}

// Every bad value of the options, in a Prefill and in a CreatePlan (for
// every layer and per layer), is INVALID_ARGUMENT naming the field and the
// bound; a request never crashes the server.
TEST(VariantsTest, BadValuesAreRefusedNamingTheField) {
  TestServerOptions options;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_TRUE(client);
  const KvGeometry g = GeometryOf(client->info());
  auto pages = client->AllocatePages(2);
  ASSERT_TRUE(pages.ok());
  std::mt19937_64 gen(1);
  KvMirror mirror(g);
  Fill(*client, mirror, *pages, 0, gen);
  PrefillInputs in;
  in.q = RandomHalves(gen, g.dtype, 4 * g.num_qo_heads * g.head_dim);
  in.qo_indptr = {0, 1, 4};
  in.kv_indptr = {0, 1, 2};
  in.kv_indices = *pages;
  in.kv_last_page_len = {16, 5};
  std::vector<float> sinks(g.num_qo_heads, 0.f);
  struct Case {
    AttentionOptions options;
    std::string message;  // after "options"
  };
  std::vector<Case> cases;
  auto add = [&](const std::string& message) -> AttentionOptions& {
    cases.push_back({AttentionOptions{}, message});
    return cases.back().options;
  };
  add(".window_left=-2 out of range [-1, 2147483647]").window_left = -2;
  add(".logits_soft_cap=nan must be 0 (no soft-cap) or in [1e-30, 1e+30]").logits_soft_cap = std::nanf("");
  add(".logits_soft_cap=-0.5 must be 0 (no soft-cap) or in [1e-30, 1e+30]").logits_soft_cap = -0.5f;
  add(".logits_soft_cap=inf must be 0 (no soft-cap) or in [1e-30, 1e+30]").logits_soft_cap = kInf;
  add(".logits_soft_cap=2.4e+38 must be 0 (no soft-cap) or in [1e-30, 1e+30]").logits_soft_cap = 2.4e38f;
  add(".sinks has 7 entries, must have num_qo_heads = 8").sinks.assign(7, 0.f);
  {
    AttentionOptions& o = add(".sinks[3]=nan must be -inf (none) or finite");
    o.sinks = sinks;
    o.sinks[3] = std::nanf("");
  }
  {
    AttentionOptions& o = add(".sinks[5]=inf must be -inf (none) or finite in [-1e+30, 1e+30]");
    o.sinks = sinks;
    o.sinks[5] = kInf;
  }
  {
    AttentionOptions& o = add(".sinks[0]=2e+30 must be -inf (none) or finite");
    o.sinks = sinks;
    o.sinks[0] = 2e30f;
  }
  for (const Case& c : cases) {
    in.options = c.options;
    auto out = client->Prefill(ArgsOf(in));
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    EXPECT_THAT(std::string(out.status().message()), HasSubstr("options" + c.message));
    PlanLayout layout{in.qo_indptr, in.kv_indptr, in.kv_indices, in.kv_last_page_len};
    layout.options = c.options;
    auto plan = client->CreatePlan(layout);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr("options" + c.message));
    layout.options = {};
    layout.layer_options = {{1, c.options}};
    plan = client->CreatePlan(layout);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr("layer_options[1]" + c.message));
  }
  in.options = {};
  // A layer the server does not have.
  PlanLayout layout{in.qo_indptr, in.kv_indptr, in.kv_indices, in.kv_last_page_len};
  layout.layer_options = {{2, AttentionOptions{}}};
  EXPECT_THAT(std::string(client->CreatePlan(layout).status().message()),
              HasSubstr("layer_options has key 2 out of range [0, 2) (num_layers)"));
  // apply_sinks of the wrong length.
  in.apply_sinks = {1, 0, 1};
  auto out = client->Prefill(ArgsOf(in));
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("apply_sinks has 3 entries, must have batch = 2"));
  in.apply_sinks = {};
  // More sinks than the server has query heads: refused at the edge, by
  // name, before they are parsed.
  for (int32_t n : {9, 1 << 16}) {
    in.options.sinks.assign(n, 0.f);
    out = client->Prefill(ArgsOf(in));
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    EXPECT_THAT(std::string(out.status().message()),
                HasSubstr("options.sinks has more than 8 entries (num_qo_heads=8)"));
    PlanLayout big{in.qo_indptr, in.kv_indptr, in.kv_indices, in.kv_last_page_len};
    big.layer_options = {{1, in.options}};
    EXPECT_THAT(std::string(client->CreatePlan(big).status().message()),
                HasSubstr("sinks has more than 8 entries (num_qo_heads=8)"));
  }
  // Still serving: a good request with every option works.
  in.options = {};
  in.options.window_left = 0;
  in.options.logits_soft_cap = 1.f;
  in.options.sinks.assign(g.num_qo_heads, -kInf);
  out = client->Prefill(ArgsOf(in));
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatches(mirror, in, *out, "after the bad ones");
}

}  // namespace
}  // namespace attnserve
