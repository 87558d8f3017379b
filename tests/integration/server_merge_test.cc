// MergeStates through the real server against the float64 merge, a split
// prefill merged back, and other geometries (GQA 32/4, fp16, head_dim 256).
#include "tests/integration/server_fixture.h"

namespace attnserve {
namespace server_test {
namespace {

TEST_P(ServerTest, MergeStatesMatchesTheReference) {
  std::mt19937_64 gen(10);
  const int64_t n = 12;
  const int32_t h = 8, d = 64;
  for (bool base_e : {false, true}) {
    for (int num_states : {1, 2, 5}) {
      SCOPED_TRACE(absl::StrCat(num_states, " states, base ", base_e ? "e" : "2"));
      std::vector<State> states(num_states);
      std::uniform_real_distribution<float> lse_dist(-30.f, 30.f);
      std::bernoulli_distribution neg_inf(0.3);
      for (State& s : states) {
        s.v = RandomHalves(gen, geo_.dtype, n * h * d);
        s.lse.resize(n * h);
        for (float& l : s.lse) l = neg_inf(gen) ? kNegInfF : lse_dist(gen);
        for (int32_t hh = 0; hh < h; ++hh) s.lse[hh] = kNegInfF;  // token 0: all -inf
      }
      auto out = client_->MergeStates(states, n, h, d, base_e);
      ASSERT_TRUE(out.ok()) << out.status();
      std::vector<double> v_ref, lse_ref;
      ReferenceMerge(states, n * h, d, geo_.dtype, base_e, &v_ref, &lse_ref);
      const Comparison c = Compare(geo_.dtype, v_ref, lse_ref, out->v, out->lse);
      EXPECT_TRUE(c.Ok(geo_.dtype)) << c.ToString();
      for (int32_t hh = 0; hh < h; ++hh) {
        EXPECT_EQ(out->lse[hh], kNegInfF);
        for (int32_t x = 0; x < d; ++x) EXPECT_EQ(HalfToFloat(geo_.dtype, out->v[hh * d + x]), 0.f);
      }
    }
  }
}

TEST_P(ServerTest, MergedSplitPrefillEqualsTheWholePrefill) {
  // Non-causal attention over pages A + B equals the LSE-merge of attention
  // over A and over B (how a client spreads one sequence over servers).
  std::mt19937_64 gen(GetParam() + 11);
  KvMirror mirror(geo_);
  const int32_t ps = geo_.page_size;
  const int32_t a_pages = GetParam() == 1 ? 40 : 3, b_pages = GetParam() == 1 ? 25 : 2;
  auto pages = client_->AllocatePages(a_pages + b_pages);
  ASSERT_TRUE(pages.ok());
  ASSERT_NO_FATAL_FAILURE(FillPages(*client_, mirror, gen, 0, *pages));
  const int32_t q_len = 7;
  const int32_t last = GetParam() == 1 ? 1 : 5;  // B ends in a partial page
  const int64_t row = int64_t{geo_.num_qo_heads} * geo_.head_dim;
  std::vector<uint16_t> q = RandomHalves(gen, geo_.dtype, q_len * row);
  auto prefill = [&](const std::vector<int32_t>& seq_pages, int32_t last_len) {
    PrefillArgs a;
    const std::vector<int32_t> qo = {0, q_len}, kv = {0, static_cast<int32_t>(seq_pages.size())},
                               lens = {last_len};
    a.q = q;
    a.qo_indptr = qo;
    a.kv_indptr = kv;
    a.kv_indices = seq_pages;
    a.kv_last_page_len = lens;
    a.causal = false;
    auto out = client_->Prefill(a);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *std::move(out) : PrefillResult{};
  };
  std::vector<int32_t> a(pages->begin(), pages->begin() + a_pages);
  std::vector<int32_t> b(pages->begin() + a_pages, pages->end());
  std::vector<int32_t> ab = a;
  ab.insert(ab.end(), b.begin(), b.end());
  const PrefillResult whole = prefill(ab, last);
  const PrefillResult part_a = prefill(a, ps);
  const PrefillResult part_b = prefill(b, last);
  std::vector<State> states = {{part_a.o, part_a.lse}, {part_b.o, part_b.lse}};
  auto merged = client_->MergeStates(states, q_len, geo_.num_qo_heads, geo_.head_dim, false);
  ASSERT_TRUE(merged.ok()) << merged.status();
  std::vector<double> o_ref(whole.o.size()), lse_ref(whole.lse.begin(), whole.lse.end());
  for (size_t i = 0; i < whole.o.size(); ++i) o_ref[i] = HalfToFloat(geo_.dtype, whole.o[i]);
  const Comparison c = Compare(geo_.dtype, o_ref, lse_ref, merged->v, merged->lse);
  EXPECT_TRUE(c.Ok(geo_.dtype)) << c.ToString();
}


// ------------------------------------------------------------ other geometries

// The FlashInfer-Bench definition's shape: 32 query heads, 4 KV heads,
// head_dim 128, page_size 1; and fp16 at page_size 16.
struct GeometryCase {
  std::string name;
  int32_t page_size, num_qo_heads, num_kv_heads, head_dim;
  std::string kv_dtype;
};

class OtherGeometryTest : public ::testing::TestWithParam<GeometryCase> {};

TEST_P(OtherGeometryTest, RaggedBatchAndMergeMatchTheReference) {
  const GeometryCase& c = GetParam();
  TestServerOptions options;
  options.page_size = c.page_size;
  options.num_pages = c.page_size == 1 ? 512 : 64;
  options.num_qo_heads = c.num_qo_heads;
  options.num_kv_heads = c.num_kv_heads;
  options.head_dim = c.head_dim;
  options.kv_dtype = c.kv_dtype;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  {
    auto client = Connect(**server);
    ASSERT_NE(client, nullptr);
    const KvGeometry g = GeometryOf(client->info());
    EXPECT_EQ(g.dtype, c.kv_dtype == "fp16" ? KvDType::kFp16 : KvDType::kBf16);
    std::mt19937_64 gen(12);
    KvMirror mirror(g);
    auto pages = client->AllocatePages(c.page_size == 1 ? 200 : 12);
    ASSERT_TRUE(pages.ok()) << pages.status();
    ASSERT_NO_FATAL_FAILURE(FillPages(*client, mirror, gen, 1, *pages));
    for (bool lse_e : {false, true}) {
      PrefillInputs in = EdgeCaseInputs(gen, g, *pages, 1, true, lse_e, 2, 24, 100);
      auto out = client->Prefill(ArgsOf(in));
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_GT(ExpectMatchesReference(mirror, in, *out), 0);
    }
    std::vector<State> states(3);
    for (State& s : states) {
      s.v = RandomHalves(gen, g.dtype, 4 * g.num_qo_heads * g.head_dim);
      s.lse.assign(4 * g.num_qo_heads, 1.f);
    }
    states[0].lse.assign(4 * g.num_qo_heads, kNegInfF);
    auto merged = client->MergeStates(states, 4, g.num_qo_heads, g.head_dim, false);
    ASSERT_TRUE(merged.ok()) << merged.status();
    std::vector<double> v_ref, lse_ref;
    ReferenceMerge(states, 4 * g.num_qo_heads, g.head_dim, g.dtype, false, &v_ref, &lse_ref);
    const Comparison cmp = Compare(g.dtype, v_ref, lse_ref, merged->v, merged->lse);
    EXPECT_TRUE(cmp.Ok(g.dtype)) << cmp.ToString();
  }
  EXPECT_EQ((*server)->Stop(), 0) << (*server)->Output();
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, OtherGeometryTest,
    ::testing::Values(GeometryCase{"H32Kv4D128Ps1Bf16", 1, 32, 4, 128, "bf16"},
                      GeometryCase{"H8Kv1D128Ps16Fp16", 16, 8, 1, 128, "fp16"},
                      GeometryCase{"H4Kv4D256Ps16Bf16", 16, 4, 4, 256, "bf16"}),
    [](const ::testing::TestParamInfo<GeometryCase>& info) { return info.param.name; });


}  // namespace
}  // namespace server_test
}  // namespace attnserve
