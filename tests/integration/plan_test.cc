// Step plans (CreatePlan / ReleasePlan, docs/design.md section 4): a layout
// registered once and named by every layer's Prefill gives the same results
// as sending the layout, checked against the float64 reference; and every
// misuse of a plan gets its code.
#include <unistd.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/workload.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Client> Connect(const TestServer& server, const std::string& token = "") {
  ClientOptions options;
  options.target = server.grpc_address();
  options.token = token;
  options.timeout_s = 60;
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

PlanLayout LayoutOf(const PrefillInputs& in, absl::Span<const int64_t> append_slots) {
  return PlanLayout{in.qo_indptr, in.kv_indptr, in.kv_indices, in.kv_last_page_len,
                    append_slots};
}

class PlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TestServerOptions options;
    options.num_layers = 3;
    auto server = TestServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = Connect(*server_);
    ASSERT_TRUE(client_);
    geo_ = GeometryOf(client_->info());
  }

  // Random KV in every slot of `pages` in every layer, mirrored.
  void Fill(KvMirror& mirror, absl::Span<const int32_t> pages, std::mt19937_64& gen) {
    const std::vector<int64_t> slots = SlotsOfPages(geo_, pages);
    for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
      const int64_t n = static_cast<int64_t>(slots.size()) * geo_.RowElems();
      const auto k = RandomHalves(gen, geo_.dtype, n), v = RandomHalves(gen, geo_.dtype, n);
      ASSERT_TRUE(client_->WriteKV(layer, slots, k, v).ok());
      mirror.Write(layer, slots, k, v);
    }
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> client_;
  KvGeometry geo_;
};

TEST_F(PlanTest, EveryLayerOfAPlannedStepMatchesTheReferenceAndTheUnplannedPrefill) {
  std::mt19937_64 gen(21);
  KvMirror mirror(geo_);
  WorkloadSpec spec;
  spec.batch = 6;
  spec.max_q_len = 9;
  spec.max_kv_len = 120;
  auto pages = client_->AllocatePages(static_cast<int32_t>(PagesNeeded(geo_, spec)) + 1);
  ASSERT_TRUE(pages.ok()) << pages.status();
  const int32_t append_page = pages->back();
  pages->pop_back();
  ASSERT_NO_FATAL_FAILURE(Fill(mirror, *pages, gen));
  for (int step = 0; step < 3; ++step) {
    PrefillInputs in = RandomPrefill(gen, geo_, spec, *pages);
    // Each step appends 3 rows to a page no sequence reads.
    std::vector<int64_t> append_slots;
    for (int i = 0; i < 3; ++i) {
      append_slots.push_back(int64_t{append_page} * geo_.page_size + (step * 3 + i) % geo_.page_size);
    }
    auto plan = client_->CreatePlan(LayoutOf(in, append_slots));
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_NE(*plan, 0u);
    for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
      in.layer = layer;
      in.q = RandomHalves(gen, geo_.dtype, in.total_q() * geo_.num_qo_heads * geo_.head_dim);
      const int64_t rows = 3 * geo_.RowElems();
      const auto ak = RandomHalves(gen, geo_.dtype, rows), av = RandomHalves(gen, geo_.dtype, rows);
      PrefillArgs planned;
      planned.layer = layer;
      planned.q = in.q;
      planned.causal = in.causal;
      planned.lse_base_e = in.lse_base_e;
      planned.append_k = ak;
      planned.append_v = av;
      planned.plan_id = *plan;
      auto got = client_->Prefill(planned);
      ASSERT_TRUE(got.ok()) << got.status();
      mirror.Write(layer, append_slots, ak, av);
      std::vector<double> o_ref, lse_ref;
      ReferencePrefill(mirror, in, &o_ref, &lse_ref);
      const Comparison c = Compare(geo_.dtype, o_ref, lse_ref, got->o, got->lse);
      EXPECT_TRUE(c.Ok(geo_.dtype)) << "step " << step << " layer " << layer << ": "
                                    << c.ToString();
      // The same request with its layout sent gives the same bytes.
      PrefillArgs sent = ArgsOf(in);
      auto direct = client_->Prefill(sent);
      ASSERT_TRUE(direct.ok()) << direct.status();
      EXPECT_EQ(direct->o, got->o);
      EXPECT_EQ(direct->lse, got->lse);
    }
    // The appended rows landed in every layer.
    for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
      auto read = client_->ReadKV(layer, append_slots);
      ASSERT_TRUE(read.ok());
      for (size_t i = 0; i < append_slots.size(); ++i) {
        EXPECT_TRUE(std::equal(read->k.begin() + i * geo_.RowElems(),
                               read->k.begin() + (i + 1) * geo_.RowElems(),
                               mirror.K(layer, append_slots[i])));
      }
    }
    ASSERT_TRUE(client_->ReleasePlan(*plan).ok());
  }
  EXPECT_TRUE(client_->FreePages(*pages).ok());
}

TEST_F(PlanTest, MisusedPlansGetClearErrors) {
  std::mt19937_64 gen(5);
  auto pages = client_->AllocatePages(4);
  ASSERT_TRUE(pages.ok());
  KvMirror mirror(geo_);
  ASSERT_NO_FATAL_FAILURE(Fill(mirror, *pages, gen));
  const std::vector<int32_t> qo = {0, 2}, kv = {0, 2}, indices = {(*pages)[0], (*pages)[1]},
                             last = {5};
  const PlanLayout layout{qo, kv, indices, last, {}};
  auto plan = client_->CreatePlan(layout);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto q = RandomHalves(gen, geo_.dtype, 2 * geo_.num_qo_heads * geo_.head_dim);

  // A page the plan holds cannot be freed, and nothing changes.
  absl::Status s = client_->FreePages({(*pages)[0]});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("(ReleasePlan) before freeing the page"));
  const int32_t free_now = client_->GetServerInfo()->free_pages();

  // Layout fields beside a plan id.
  PrefillArgs both;
  both.q = q;
  both.plan_id = *plan;
  both.qo_indptr = qo;
  s = client_->Prefill(both).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("plan_id is set"));
  // q with other rows than the plan's.
  PrefillArgs rows;
  rows.q = absl::MakeConstSpan(q).subspan(0, geo_.num_qo_heads * geo_.head_dim);
  rows.plan_id = *plan;
  s = client_->Prefill(rows).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("must equal the plan's query rows 2"));
  // An id the server never made.
  PrefillArgs unknown;
  unknown.q = q;
  unknown.plan_id = *plan ^ 0x5a5a;
  s = client_->Prefill(unknown).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("is unknown"));
  // A layout that does not validate.
  const std::vector<int32_t> bad_last = {geo_.page_size + 1};
  s = client_->CreatePlan(PlanLayout{qo, kv, indices, bad_last, {}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("kv_last_page_len[0]"));
  EXPECT_EQ(client_->GetServerInfo()->free_pages(), free_now);

  // Released: the id is gone and the pages may be freed.
  ASSERT_TRUE(client_->ReleasePlan(*plan).ok());
  PrefillArgs released;
  released.q = q;
  released.plan_id = *plan;
  EXPECT_EQ(client_->Prefill(released).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ReleasePlan(*plan).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(client_->FreePages(*pages).ok());
}

// The metrics' shape of a Prefill naming a plan is its plan's: `decode`
// when every planned sequence has at most 8 query rows, else `prefill`
// (the request carries no layout of its own). One whose plan is not found,
// and one whose body cannot be parsed, count as `prefill`.
TEST_F(PlanTest, PlannedPrefillsCountUnderTheirPlansShape) {
  std::mt19937_64 gen(12);
  auto pages = client_->AllocatePages(4);
  ASSERT_TRUE(pages.ok());
  KvMirror mirror(geo_);
  ASSERT_NO_FATAL_FAILURE(Fill(mirror, *pages, gen));
  auto count = [&](const std::string& code, const std::string& shape) {
    auto text = HttpGet(server_->metrics_address(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    if (!text.ok()) return -1.0;
    auto v = MetricValue(*text, "attnserve_requests_total",
                         absl::StrCat("code=\"", code, "\",method=\"Prefill\",shape=\"", shape, "\""));
    return v.ok() ? *v : 0.0;
  };
  const std::vector<int32_t> kv = {0, 2}, indices = {(*pages)[0], (*pages)[1]},
                             last = {geo_.page_size};
  for (const int32_t rows : {64, 8}) {
    const std::vector<int32_t> qo = {0, rows};
    auto plan = client_->CreatePlan(PlanLayout{qo, kv, indices, last, {}});
    ASSERT_TRUE(plan.ok()) << plan.status();
    const double decode0 = count("OK", "decode"), prefill0 = count("OK", "prefill");
    const auto q = RandomHalves(gen, geo_.dtype, int64_t{rows} * geo_.num_qo_heads * geo_.head_dim);
    PrefillArgs planned;
    planned.q = q;
    planned.plan_id = *plan;
    ASSERT_TRUE(client_->Prefill(planned).ok());
    EXPECT_EQ(count("OK", "prefill") - prefill0, rows > 8 ? 1 : 0) << rows << " rows";
    EXPECT_EQ(count("OK", "decode") - decode0, rows > 8 ? 0 : 1) << rows << " rows";
    ASSERT_TRUE(client_->ReleasePlan(*plan).ok());
    const double missing0 = count("NOT_FOUND", "prefill");
    EXPECT_EQ(client_->Prefill(planned).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(count("NOT_FOUND", "prefill") - missing0, 1);
  }
  // A body that is not a PrefillRequest.
  auto channel = grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const std::string junk = "\xff\xff\xff\xff";
  grpc::Slice slice(junk.data(), junk.size());
  grpc::ByteBuffer request(&slice, 1), response;
  absl::Notification done;
  grpc::Status status;
  const double bad0 = count("INVALID_ARGUMENT", "prefill");
  stub.UnaryCall(&ctx, "/attnserve.v1.AttentionService/Prefill", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status st) {
                   status = std::move(st);
                   done.Notify();
                 });
  done.WaitForNotification();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_EQ(count("INVALID_ARGUMENT", "prefill") - bad0, 1);
  EXPECT_EQ(count("INVALID_ARGUMENT", "none"), 0);
  EXPECT_TRUE(client_->FreePages(*pages).ok());
}

TEST(PlanLimitsTest, TenantsPlansAreTheirOwnAndCappedAndDieWithTheServer) {
  auto tokens = WriteTokensFile("tok-a alice\ntok-b bob\n");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  const std::string path = *tokens;
  TestServerOptions options;
  options.extra_flags = {absl::StrCat("--auth_tokens_file=", path), "--max_plans_per_tenant=2"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto alice = Connect(**server, "tok-a"), bob = Connect(**server, "tok-b");
  ASSERT_TRUE(alice && bob);
  auto a_pages = alice->AllocatePages(1), b_pages = bob->AllocatePages(1);
  ASSERT_TRUE(a_pages.ok() && b_pages.ok());
  const std::vector<int32_t> qo = {0, 1}, kv = {0, 1}, last = {1};
  const std::vector<int32_t> a_index = {(*a_pages)[0]}, b_index = {(*b_pages)[0]};
  {  // The key the plans read (--check_kv_written).
    std::mt19937_64 gen(2);
    const KvGeometry g = GeometryOf(alice->info());
    const std::vector<int64_t> slot = {int64_t{(*a_pages)[0]} * g.page_size};
    const auto row = RandomHalves(gen, g.dtype, g.RowElems());
    ASSERT_TRUE(alice->WriteKV(0, slot, row, row).ok());
  }
  // Another tenant's pages cannot go into a plan.
  absl::Status s = alice->CreatePlan(PlanLayout{qo, kv, b_index, last, {}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  auto p1 = alice->CreatePlan(PlanLayout{qo, kv, a_index, last, {}});
  auto p2 = alice->CreatePlan(PlanLayout{qo, kv, a_index, last, {}});
  ASSERT_TRUE(p1.ok() && p2.ok());
  // The cap is per tenant.
  s = alice->CreatePlan(PlanLayout{qo, kv, a_index, last, {}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("--max_plans_per_tenant"));
  EXPECT_TRUE(bob->CreatePlan(PlanLayout{qo, kv, b_index, last, {}}).ok());
  // Bob can neither use nor release Alice's plan.
  std::mt19937_64 gen(3);
  const KvGeometry g = GeometryOf(bob->info());
  const auto q = RandomHalves(gen, g.dtype, int64_t{g.num_qo_heads} * g.head_dim);
  PrefillArgs args;
  args.q = q;
  args.plan_id = *p1;
  EXPECT_EQ(bob->Prefill(args).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(bob->ReleasePlan(*p1).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(alice->Prefill(args).ok());

  // After a restart the plan is gone: a client that remembers the old server
  // is told so, one that does not gets NOT_FOUND.
  const std::string address = (*server)->grpc_address();
  ASSERT_EQ((*server)->Stop(), 0);
  options.extra_flags.push_back(absl::StrCat("--listen=", address));
  auto restarted = TestServer::Start(options);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  absl::Status stale;
  for (int i = 0; i < 200; ++i) {  // the channel reconnects
    stale = alice->Prefill(args).status();
    if (!absl::IsUnavailable(stale)) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  alice->ForgetIncarnation();
  EXPECT_EQ(alice->Prefill(args).status().code(), absl::StatusCode::kNotFound);
  unlink(path.c_str());
}

}  // namespace
}  // namespace attnserve
