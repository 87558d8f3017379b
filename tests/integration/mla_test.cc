// Multi-head latent attention through the real server (docs/design.md,
// "Multi-head latent attention"): what ServerInfo says of an MLA server, its
// page bytes (one latent pool), writes of latent rows (k alone), ReadKV,
// Prefill and decode over ragged batches at page sizes 1, 16 and 64 against
// the float64 reference (plain and with random variants, fused appends,
// plans, both LSE bases), a sequence split over two servers (kv_keys_after)
// merged by MergeStates on v_head_dim-wide states, and the errors: a GQA
// request to an MLA server and the reverse get INVALID_ARGUMENT naming the
// field, and nothing stored changes.
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/integration/server_fixture.h"

namespace attnserve {
namespace server_test {
namespace {

// Small latent sizes keep the CPU fast; the shapes are DeepSeek's in form
// (qk_head_dim = kv_lora_rank + qk_rope_head_dim, v_head_dim = kv_lora_rank).
// $ATTNSERVE_TEST_MLA_WIDTHS="RANK,ROPE" sets others: bench/run_mla_gpu.sh
// runs these tests against a CUDA server (ATTNSERVE_TEST_SERVER_FLAGS=
// --backend=cuda) at DeepSeek's 512,64, the widths its kernels take.
int32_t Width(int which, int32_t fallback) {
  const char* env = std::getenv("ATTNSERVE_TEST_MLA_WIDTHS");
  if (env == nullptr || *env == '\0') return fallback;
  const std::vector<std::string> parts = absl::StrSplit(env, ',');
  int32_t v = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[which], &v)) {
    ADD_FAILURE() << "ATTNSERVE_TEST_MLA_WIDTHS=" << env << ": want RANK,ROPE";
    return fallback;
  }
  return v;
}
const int32_t kLoraRank = Width(0, 64);
const int32_t kRopeDim = Width(1, 16);

struct MlaServer {
  std::unique_ptr<TestServer> server;
  std::unique_ptr<Client> client;
  KvGeometry geo;
};

MlaServer StartMla(int32_t page_size, int32_t num_qo_heads = 8,
                   std::vector<std::string> extra = {}) {
  MlaServer s;
  TestServerOptions options;
  options.page_size = page_size;
  options.num_pages = page_size == 1 ? 2048 : 256;
  options.num_qo_heads = num_qo_heads;
  options.kv_lora_rank = kLoraRank;
  options.qk_rope_head_dim = kRopeDim;
  options.extra_flags = std::move(extra);
  auto server = TestServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return s;
  s.server = *std::move(server);
  s.client = Connect(*s.server);
  if (s.client != nullptr) s.geo = GeometryOf(s.client->info());
  return s;
}

void ExpectInvalid(const absl::Status& s, const std::string& field) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(field)) << s;
}

TEST(MlaServerTest, InfoReportsTheLatentGeometryAndOnePool) {
  MlaServer s = StartMla(16, 8, {"--kv_cache_bytes=4194304"});
  ASSERT_TRUE(s.client);
  const v1::ServerInfo& info = s.client->info();
  EXPECT_EQ(info.attention(), v1::ATTENTION_MLA);
  EXPECT_EQ(info.num_kv_heads(), 1);
  EXPECT_EQ(info.head_dim(), kLoraRank + kRopeDim);
  EXPECT_EQ(info.qk_head_dim(), kLoraRank + kRopeDim);
  EXPECT_EQ(info.v_head_dim(), kLoraRank);
  EXPECT_EQ(info.kv_lora_rank(), kLoraRank);
  EXPECT_EQ(info.qk_rope_head_dim(), kRopeDim);
  // One latent row a slot: 2 layers x 16 rows x 80 values x 2 bytes.
  EXPECT_EQ(info.page_bytes(), 2 * 16 * (kLoraRank + kRopeDim) * 2);
  EXPECT_EQ(info.num_pages(), 4194304 / info.page_bytes());
  EXPECT_THAT(s.server->Output(), HasSubstr("attention=mla"));
  EXPECT_THAT(s.server->Output(), HasSubstr(absl::StrCat("v_head_dim=", kLoraRank)));
  const KvGeometry& g = s.geo;
  EXPECT_TRUE(g.IsMla());
  EXPECT_EQ(g.VDim(), kLoraRank);

  // A GQA server says so, with both widths equal to head_dim.
  auto gqa = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(gqa.ok());
  auto c = Connect(**gqa);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->info().attention(), v1::ATTENTION_GQA);
  EXPECT_EQ(c->info().qk_head_dim(), 64);
  EXPECT_EQ(c->info().v_head_dim(), 64);
  EXPECT_EQ(c->info().kv_lora_rank(), 0);
  EXPECT_EQ(s.server->Stop(), 0);
  EXPECT_EQ((*gqa)->Stop(), 0);
}

class MlaPrefillTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(MlaPrefillTest, RaggedPrefillAndDecodeMatchTheReference) {
  MlaServer s = StartMla(GetParam());
  ASSERT_TRUE(s.client);
  const KvGeometry& g = s.geo;
  std::mt19937_64 gen(31 + GetParam());
  auto pages = s.client->AllocatePages(GetParam() == 1 ? 400 : 40);
  ASSERT_TRUE(pages.ok()) << pages.status();
  KvMirror mirror(g);
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    FillPages(*s.client, mirror, gen, layer, *pages);
  }
  // ReadKV answers the latent rows in k and no v.
  const std::vector<int64_t> some = {0, 5, int64_t{g.page_size} * (*pages)[3] + g.page_size - 1};
  auto read = s.client->ReadKV(1, some);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->k.size(), some.size() * g.RowElems());
  EXPECT_TRUE(read->v.empty());
  for (size_t i = 0; i < some.size(); ++i) {
    EXPECT_TRUE(std::equal(read->k.begin() + i * g.RowElems(),
                           read->k.begin() + (i + 1) * g.RowElems(), mirror.K(1, some[i])));
  }
  for (int round = 0; round < 6; ++round) {
    const bool causal = round % 3 != 2;
    PrefillInputs in = EdgeCaseInputs(gen, g, *pages, round % 2, causal, round % 2 == 1);
    in.sm_scale = 1.f / std::sqrt(192.f);  // the client's, as DeepSeek's
    if (round >= 3) in.options = RandomOptions(gen, g, 160);
    auto out = s.client->Prefill(ArgsOf(in));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->o.size(), in.total_q() * g.num_qo_heads * kLoraRank);
    ExpectMatchesReference(mirror, in, *out);
    // Decode: one row per sequence.
    WorkloadSpec spec;
    spec.batch = 5;
    spec.max_q_len = 1;
    spec.max_kv_len = 200;
    PrefillInputs dec = RandomPrefill(gen, g, spec, *pages);
    dec.layer = round % 2;
    auto d = s.client->Prefill(ArgsOf(dec));
    ASSERT_TRUE(d.ok()) << d.status();
    ExpectMatchesReference(mirror, dec, *d);
  }
  // The kernel label names the MLA family: its requests' launches, none
  // under the GQA families' labels.
  auto metrics = HttpGet(s.server->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  auto launches = [&](const char* kernel) {
    auto v = MetricValue(*metrics, "attnserve_kernel_launches_total",
                         absl::StrCat("kernel=\"", kernel, "\""));
    EXPECT_TRUE(v.ok()) << kernel << ": " << v.status();
    return v.ok() ? *v : -1.0;
  };
  EXPECT_GT(launches("attention_mla"), 0);
  EXPECT_EQ(launches("attention_prefill"), 0);
  EXPECT_EQ(launches("attention_decode"), 0);
  EXPECT_EQ(s.server->Stop(), 0);
}

INSTANTIATE_TEST_SUITE_P(PageSizes, MlaPrefillTest, ::testing::Values(1, 16, 64),
                         PageSizeName);

TEST(MlaServerTest, FusedAppendAndPlansTakeTheLatentRowsAlone) {
  MlaServer s = StartMla(16);
  ASSERT_TRUE(s.client);
  const KvGeometry& g = s.geo;
  std::mt19937_64 gen(7);
  auto pages = s.client->AllocatePages(8);
  ASSERT_TRUE(pages.ok());
  KvMirror mirror(g);
  // Sequence of 40 keys on pages 0..2: the first 37 written, the last 3
  // appended by the Prefill that attends over them (3 query rows).
  const std::vector<int32_t> seq_pages = {(*pages)[2], (*pages)[0], (*pages)[5]};
  std::vector<int64_t> slots;
  for (int32_t j = 0; j < 40; ++j) {
    slots.push_back(int64_t{seq_pages[j / g.page_size]} * g.page_size + j % g.page_size);
  }
  const std::vector<int64_t> first(slots.begin(), slots.begin() + 37);
  const std::vector<int64_t> tail(slots.begin() + 37, slots.end());
  auto k0 = RandomHalves(gen, g.dtype, 37 * g.RowElems());
  ASSERT_TRUE(s.client->WriteKV(0, first, k0, {}).ok());
  mirror.Write(0, first, k0, {});
  auto k1 = RandomHalves(gen, g.dtype, 3 * g.RowElems());
  PrefillInputs in;
  in.q = RandomHalves(gen, g.dtype, 3 * g.QRowElems());
  in.qo_indptr = {0, 3};
  in.kv_indptr = {0, 3};
  in.kv_indices = seq_pages;
  in.kv_last_page_len = {40 - 2 * g.page_size};
  PrefillArgs args = ArgsOf(in);
  args.append_slots = tail;
  args.append_k = k1;
  auto out = s.client->Prefill(args);
  ASSERT_TRUE(out.ok()) << out.status();
  mirror.Write(0, tail, k1, {});
  ExpectMatchesReference(mirror, in, *out);

  // The same step through a plan whose append rows are its slots.
  PlanLayout layout{in.qo_indptr, in.kv_indptr, in.kv_indices, in.kv_last_page_len, tail, {}};
  auto plan = s.client->CreatePlan(layout);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto k2 = RandomHalves(gen, g.dtype, 3 * g.RowElems());
  PrefillArgs planned;
  planned.q = in.q;
  planned.plan_id = *plan;
  planned.append_k = k2;
  auto via_plan = s.client->Prefill(planned);
  ASSERT_TRUE(via_plan.ok()) << via_plan.status();
  mirror.Write(0, tail, k2, {});
  ExpectMatchesReference(mirror, in, *via_plan);
  ASSERT_TRUE(s.client->ReleasePlan(*plan).ok());
  EXPECT_EQ(s.server->Stop(), 0);
}

TEST(MlaServerTest, HalvesOnTwoServersMergeIntoTheWholeSequence) {
  MlaServer a = StartMla(16), b = StartMla(16);
  ASSERT_TRUE(a.client && b.client);
  const KvGeometry& g = a.geo;
  std::mt19937_64 gen(9);
  // 90 keys: 0..40 on a, 41..89 on b; the last 20 positions are the queries.
  const int32_t total = 90, split = 41, q_len = 20;
  auto pa = a.client->AllocatePages(3), pb = b.client->AllocatePages(4);
  ASSERT_TRUE(pa.ok() && pb.ok());
  KvMirror ma(g), mb(g);
  FillPages(*a.client, ma, gen, 0, *pa);
  FillPages(*b.client, mb, gen, 0, *pb);
  const auto q = RandomHalves(gen, g.dtype, int64_t{q_len} * g.QRowElems());
  auto half = [&](const std::vector<int32_t>& pages, int32_t len, int32_t after) {
    PrefillInputs in;
    in.q = q;
    in.qo_indptr = {0, q_len};
    in.kv_indptr = {0, (len + g.page_size - 1) / g.page_size};
    in.kv_indices.assign(pages.begin(), pages.begin() + in.kv_indptr[1]);
    in.kv_last_page_len = {len - (in.kv_indptr[1] - 1) * g.page_size};
    in.kv_keys_after = {after};
    return in;
  };
  auto oa = a.client->Prefill(ArgsOf(half(*pa, split, total - split)));
  auto ob = b.client->Prefill(ArgsOf(half(*pb, total - split, 0)));
  ASSERT_TRUE(oa.ok() && ob.ok());
  const State states[] = {{oa->o, oa->lse}, {ob->o, ob->lse}};
  auto merged = a.client->MergeStates(states, q_len, g.num_qo_heads, g.VDim(), false);
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
    const int32_t page = on_a ? (*pa)[local / g.page_size] : (*pb)[local / g.page_size];
    const int64_t slot = int64_t{page} * g.page_size + local % g.page_size;
    const uint16_t* row = on_a ? ma.K(0, slot) : mb.K(0, slot);
    const int64_t one[] = {p};
    whole.Write(0, one, absl::MakeConstSpan(row, g.RowElems()), {});
    in.kv_indices.push_back(p);
  }
  in.kv_last_page_len = {1};
  std::vector<double> o_ref, lse_ref;
  ReferencePrefill(whole, in, &o_ref, &lse_ref);
  const Comparison c = Compare(g.dtype, o_ref, lse_ref, merged->v, merged->lse);
  EXPECT_TRUE(c.Ok(g.dtype)) << c.ToString();
  EXPECT_EQ(a.server->Stop(), 0);
  EXPECT_EQ(b.server->Stop(), 0);
}

TEST(MlaServerTest, GqaRequestsToAnMlaServerAndTheReverseNameTheField) {
  MlaServer s = StartMla(16);
  ASSERT_TRUE(s.client);
  const KvGeometry& g = s.geo;
  std::mt19937_64 gen(3);
  auto pages = s.client->AllocatePages(2);
  ASSERT_TRUE(pages.ok());
  KvMirror mirror(g);
  FillPages(*s.client, mirror, gen, 0, *pages);
  const Snapshot before = Read(*s.client, g, *pages);
  const std::vector<int64_t> slots = {int64_t{(*pages)[0]} * g.page_size};
  const auto row = RandomHalves(gen, g.dtype, g.RowElems());
  // A V tensor: refused, naming v (the C++ client sends a non-empty one).
  ExpectInvalid(s.client->WriteKV(0, slots, row, row), "v must be unset");
  // GQA-shaped rows: [1, 2, 64] instead of [1, 1, 80].
  ExpectInvalid(s.client->WriteKV(0, slots, RandomHalves(gen, g.dtype, 2 * 64), {}), "k");
  // A fused append with append_v.
  PrefillInputs in;
  in.q = RandomHalves(gen, g.dtype, g.QRowElems());
  in.qo_indptr = {0, 1};
  in.kv_indptr = {0, 1};
  in.kv_indices = {(*pages)[0]};
  in.kv_last_page_len = {1};
  PrefillArgs args = ArgsOf(in);
  args.append_slots = slots;
  args.append_k = row;
  args.append_v = row;
  ExpectInvalid(s.client->Prefill(args).status(), "append_v");
  // Queries of a GQA head_dim (64 wide, not 80).
  PrefillInputs narrow = in;
  narrow.q = RandomHalves(gen, g.dtype, int64_t{g.num_qo_heads} * 64);
  ExpectInvalid(s.client->Prefill(ArgsOf(narrow)).status(), "q");
  // ReadKV into a V region: there is no V.
  {
    v1::ReadKVRequest req;
    req.set_layer(0);
    req.add_slots(slots[0]);
    req.mutable_k_region()->set_name("x");
    req.mutable_v_region()->set_name("y");
    auto channel = grpc::CreateChannel(s.server->grpc_address(), grpc::InsecureChannelCredentials());
    auto stub = v1::AttentionService::NewStub(channel);
    grpc::ClientContext ctx;
    v1::ReadKVResponse resp;
    const grpc::Status st = stub->ReadKV(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(st.error_message(), HasSubstr("v_region"));
  }
  EXPECT_TRUE(Read(*s.client, g, *pages) == before) << "a refused request changed the cache";

  // The reverse: a GQA server given MLA's latent rows (no v) or latent queries.
  auto gqa = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(gqa.ok());
  auto c = Connect(**gqa);
  ASSERT_TRUE(c);
  const KvGeometry gg = GeometryOf(c->info());
  auto gp = c->AllocatePages(1);
  ASSERT_TRUE(gp.ok());
  const std::vector<int64_t> gslots = {int64_t{(*gp)[0]} * gg.page_size};
  ExpectInvalid(c->WriteKV(0, gslots, RandomHalves(gen, gg.dtype, gg.RowElems()), {}), "v");
  PrefillInputs latent = in;
  latent.kv_indices = {(*gp)[0]};
  latent.q = RandomHalves(gen, gg.dtype, int64_t{gg.num_qo_heads} * (kLoraRank + kRopeDim));
  ExpectInvalid(c->Prefill(ArgsOf(latent)).status(), "q");
  EXPECT_EQ(s.server->Stop(), 0);
  EXPECT_EQ((*gqa)->Stop(), 0);
}

}  // namespace
}  // namespace server_test
}  // namespace attnserve
