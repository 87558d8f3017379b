// kv_keys_after (docs/design.md section 3): a Prefill over a range of a
// longer sequence keeps the whole sequence's causal mask, with the layout
// sent and with a plan, checked against the float64 reference; the halves
// of a sequence on two servers merge (MergeStates) into the whole; and bad
// values get INVALID_ARGUMENT naming the field, the index and the bound.
#include <algorithm>
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
  options.timeout_s = 60;
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// Random K/V into every slot of `pages`, mirrored.
void Fill(Client& client, KvMirror& mirror, absl::Span<const int32_t> pages, int32_t layer,
          std::mt19937_64& gen) {
  const KvGeometry& g = mirror.geometry();
  const std::vector<int64_t> slots = SlotsOfPages(g, pages);
  const int64_t n = static_cast<int64_t>(slots.size()) * g.RowElems();
  const auto k = RandomHalves(gen, g.dtype, n), v = RandomHalves(gen, g.dtype, n);
  ASSERT_TRUE(client.WriteKV(layer, slots, k, v).ok());
  mirror.Write(layer, slots, k, v);
}

TEST(KvKeysAfterTest, ARangeOfALongerSequenceKeepsItsCausalMask) {
  for (int32_t page_size : {1, 16}) {
    TestServerOptions options;
    options.page_size = page_size;
    options.num_pages = 2048 / page_size;
    auto server = TestServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = Connect(**server);
    ASSERT_TRUE(client);
    const KvGeometry g = GeometryOf(client->info());
    std::mt19937_64 gen(page_size);
    auto pages = client->AllocatePages(static_cast<int32_t>(PagesNeeded(g, {4, 48, 200})));
    ASSERT_TRUE(pages.ok()) << pages.status();
    KvMirror mirror(g);
    Fill(*client, mirror, *pages, 0, gen);
    for (int round = 0; round < 4; ++round) {
      WorkloadSpec spec;
      spec.batch = 4;
      spec.max_q_len = 48;
      spec.max_kv_len = 200;
      PrefillInputs in = RandomPrefill(gen, g, spec, *pages);
      // 0 (bottom-right), a few, past the queries, and past the last row's reach.
      in.kv_keys_after = {0, 3, 37, 500};
      std::vector<double> o_ref, lse_ref;
      ReferencePrefill(mirror, in, &o_ref, &lse_ref);
      auto out = client->Prefill(ArgsOf(in));
      ASSERT_TRUE(out.ok()) << out.status();
      Comparison c = Compare(g.dtype, o_ref, lse_ref, out->o, out->lse);
      EXPECT_TRUE(c.Ok(g.dtype)) << "page_size " << page_size << ": " << c.ToString();
      // The same through a plan.
      PlanLayout layout{in.qo_indptr, in.kv_indptr, in.kv_indices, in.kv_last_page_len, {},
                        in.kv_keys_after};
      auto plan = client->CreatePlan(layout);
      ASSERT_TRUE(plan.ok()) << plan.status();
      PrefillArgs planned;
      planned.q = in.q;
      planned.plan_id = *plan;
      auto via_plan = client->Prefill(planned);
      ASSERT_TRUE(via_plan.ok()) << via_plan.status();
      c = Compare(g.dtype, o_ref, lse_ref, via_plan->o, via_plan->lse);
      EXPECT_TRUE(c.Ok(g.dtype)) << "plan, page_size " << page_size << ": " << c.ToString();
      // A plan's Prefill must not bring its own.
      planned.kv_keys_after = in.kv_keys_after;
      auto both = client->Prefill(planned);
      EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(both.status().message()), HasSubstr("kv_keys_after"));
      ASSERT_TRUE(client->ReleasePlan(*plan).ok());
    }
  }
}

TEST(KvKeysAfterTest, HalvesOnTwoServersMergeIntoTheWholeSequence) {
  TestServerOptions options;
  auto a = TestServer::Start(options);
  auto b = TestServer::Start(options);
  ASSERT_TRUE(a.ok() && b.ok());
  auto ca = Connect(**a), cb = Connect(**b);
  ASSERT_TRUE(ca && cb);
  const KvGeometry g = GeometryOf(ca->info());
  std::mt19937_64 gen(5);
  // One sequence of 100 keys: 0..52 on a (a non-page boundary), 53..99 on b;
  // its last 40 positions are the queries.
  const int32_t total = 100, split = 53, q_len = 40;
  auto pa = ca->AllocatePages(4), pb = cb->AllocatePages(3);
  ASSERT_TRUE(pa.ok() && pb.ok());
  KvMirror ma(g), mb(g);
  Fill(*ca, ma, *pa, 0, gen);
  Fill(*cb, mb, *pb, 0, gen);
  const auto q = RandomHalves(gen, g.dtype, int64_t{q_len} * g.num_qo_heads * g.head_dim);
  auto half = [&](const std::vector<int32_t>& pages, int32_t len, int32_t after) {
    PrefillInputs in;
    in.q = q;
    in.qo_indptr = {0, q_len};
    in.kv_indptr = {0, static_cast<int32_t>((len + g.page_size - 1) / g.page_size)};
    in.kv_indices.assign(pages.begin(), pages.begin() + in.kv_indptr[1]);
    in.kv_last_page_len = {len - (in.kv_indptr[1] - 1) * g.page_size};
    in.kv_keys_after = {after};
    return in;
  };
  PrefillInputs in_a = half(*pa, split, total - split), in_b = half(*pb, total - split, 0);
  auto oa = ca->Prefill(ArgsOf(in_a));
  auto ob = cb->Prefill(ArgsOf(in_b));
  ASSERT_TRUE(oa.ok() && ob.ok());
  const State states[] = {{oa->o, oa->lse}, {ob->o, ob->lse}};
  auto merged = ca->MergeStates(states, q_len, g.num_qo_heads, g.head_dim, false);
  ASSERT_TRUE(merged.ok()) << merged.status();
  // The reference: the whole sequence on one (virtual) server, page_size 1.
  KvGeometry whole_geo = g;
  whole_geo.page_size = 1;
  whole_geo.num_pages = total;
  KvMirror whole(whole_geo);
  PrefillInputs in;
  in.q = q;
  in.qo_indptr = {0, q_len};
  in.kv_indptr = {0, total};
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
  const Comparison c = Compare(g.dtype, o_ref, lse_ref, merged->v, merged->lse);
  EXPECT_TRUE(c.Ok(g.dtype)) << c.ToString();
}

TEST(KvKeysAfterTest, BadValuesAreRefusedNamingTheFieldAndTheBound) {
  TestServerOptions options;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_TRUE(client);
  const KvGeometry g = GeometryOf(client->info());
  auto pages = client->AllocatePages(2);
  ASSERT_TRUE(pages.ok());
  std::mt19937_64 gen(1);
  PrefillInputs in;
  in.q = RandomHalves(gen, g.dtype, 4 * g.num_qo_heads * g.head_dim);
  in.qo_indptr = {0, 1, 4};
  in.kv_indptr = {0, 1, 2};
  in.kv_indices = *pages;
  in.kv_last_page_len = {16, 5};
  struct Case {
    std::vector<int32_t> after;
    std::string message;
  };
  const Case cases[] = {
      {{1}, "kv_keys_after has 1 entries, must have batch = 2"},
      {{1, 2, 3}, "kv_keys_after has 3 entries, must have batch = 2"},
      {{0, -4}, "kv_keys_after[1]=-4 out of range [0, 2147483642]"},
      {{INT32_MAX, 0}, "kv_keys_after[0]=2147483647 out of range [0, 2147483631]"},
  };
  for (const Case& c : cases) {
    in.kv_keys_after = c.after;
    auto out = client->Prefill(ArgsOf(in));
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    EXPECT_THAT(std::string(out.status().message()), HasSubstr(c.message));
    PlanLayout layout{in.qo_indptr, in.kv_indptr, in.kv_indices, in.kv_last_page_len, {},
                      in.kv_keys_after};
    auto plan = client->CreatePlan(layout);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
    EXPECT_THAT(std::string(plan.status().message()), HasSubstr(c.message));
  }
  // More entries than a request may hold: refused at the edge, by name.
  in.kv_keys_after.assign(1 << 20, 0);
  auto out = client->Prefill(ArgsOf(in));
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("kv_keys_after"));
}

}  // namespace
}  // namespace attnserve
