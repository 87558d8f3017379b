// FP8 KV caches through the real server (docs/design.md, "FP8 KV cache"):
// the flags and what ServerInfo and /metrics say (twice the pages in the same
// --kv_cache_bytes), writes quantized by the server (WriteKV and fused
// appends, 16-bit rows) or stored as they are (FP8 rows), ReadKV's stored
// bytes and dequantized rows, KV scales (SetKvScales, GetKvScales), Prefill
// against the float64 reference over the dequantized values, and every bad
// input: INVALID_ARGUMENT naming the field, and nothing stored changes.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/fp8.h"
#include "tests/integration/server_fixture.h"

namespace attnserve {
namespace server_test {
namespace {

struct Fp8Server {
  std::unique_ptr<TestServer> server;
  std::unique_ptr<Client> client;
  KvGeometry geo;
};

Fp8Server StartServer(const std::string& kv_dtype, const std::string& q_dtype,
                      int32_t page_size = 16, std::vector<std::string> extra = {},
                      const std::string& token = "") {
  Fp8Server s;
  TestServerOptions options;
  options.page_size = page_size;
  options.num_pages = page_size == 1 ? 2048 : 256;
  options.kv_dtype = kv_dtype;
  if (!q_dtype.empty()) extra.push_back("--q_dtype=" + q_dtype);
  options.extra_flags = std::move(extra);
  auto server = TestServer::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return s;
  s.server = *std::move(server);
  s.client = Connect(*s.server, token);
  if (s.client != nullptr) s.geo = GeometryOf(s.client->info());
  return s;
}

// The FP8 bytes of 16-bit rows as the server stores them (kernels/fp8.h,
// whose own tests check it against the formats' definitions).
std::vector<uint8_t> Quantize(const KvGeometry& g, const std::vector<uint16_t>& rows,
                              const std::vector<float>& head_scales) {
  std::vector<uint8_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const float s = head_scales[(i % g.RowElems()) / g.head_dim];
    out[i] = Fp8Quantize(g.kv_fp8, HalfToFloat(g.dtype, rows[i]), s);
  }
  return out;
}

std::vector<LayerKvScales> ScalesOf(Client& client) {
  auto scales = client.GetKvScales();
  EXPECT_TRUE(scales.ok()) << scales.status();
  return scales.ok() ? *scales : std::vector<LayerKvScales>{};
}

bool SameScales(const std::vector<LayerKvScales>& a, const std::vector<LayerKvScales>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].layer != b[i].layer || a[i].k_scale != b[i].k_scale || a[i].v_scale != b[i].v_scale) {
      return false;
    }
  }
  return true;
}

TEST(Fp8ServerTest, InfoAndMetricsReportTheDtypesAndTwiceThePages) {
  const std::string bytes = "--kv_cache_bytes=8388608";  // 8 MiB
  Fp8Server bf16 = StartServer("bf16", "", 16, {bytes});
  Fp8Server fp8 = StartServer("fp8_e4m3", "fp16", 16, {bytes});
  ASSERT_TRUE(bf16.client && fp8.client);
  const v1::ServerInfo& a = bf16.client->info();
  const v1::ServerInfo& b = fp8.client->info();
  EXPECT_EQ(a.kv_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(a.q_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(b.kv_dtype(), v1::DTYPE_FP8_E4M3);
  EXPECT_EQ(b.q_dtype(), v1::DTYPE_FP16);
  // 2 layers x K and V x 16 rows x 2 heads x 64: 8192 elements a page.
  EXPECT_EQ(a.page_bytes(), 8192 * 2);
  EXPECT_EQ(b.page_bytes(), 8192);
  EXPECT_EQ(a.num_pages(), 8388608 / (8192 * 2));
  EXPECT_EQ(b.num_pages(), 2 * a.num_pages());
  EXPECT_EQ(a.kv_cache_bytes(), int64_t{a.num_pages()} * a.page_bytes());
  EXPECT_EQ(b.kv_cache_bytes(), int64_t{b.num_pages()} * b.page_bytes());
  EXPECT_EQ(b.free_pages(), b.num_pages());
  // The CPU backend never rounds queries (--prefill_kernel=sm90_fp8q is CUDA's).
  EXPECT_EQ(a.fp8_query_min_rows(), 0);
  EXPECT_EQ(b.fp8_query_min_rows(), 0);
  const KvGeometry g = GeometryOf(b);
  EXPECT_EQ(g.kv_fp8, Fp8Format::kE4m3);
  EXPECT_EQ(g.dtype, KvDType::kFp16);

  for (const Fp8Server* s : {&bf16, &fp8}) {
    auto metrics = HttpGet(s->server->metrics_address(), "/metrics");
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    const v1::ServerInfo& info = s->client->info();
    EXPECT_EQ(MetricValue(*metrics, "attnserve_kv_cache_bytes").value_or(-1),
              static_cast<double>(info.kv_cache_bytes()));
    EXPECT_EQ(MetricValue(*metrics, "attnserve_kv_pages", "state=\"free\"").value_or(-1),
              static_cast<double>(info.num_pages()));
  }
  auto metrics = HttpGet(fp8.server->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_THAT(*metrics, HasSubstr("kv_dtype=\"fp8_e4m3\""));
  EXPECT_THAT(*metrics, HasSubstr("q_dtype=\"fp16\""));
  EXPECT_THAT(fp8.server->Output(), HasSubstr("kv_dtype=fp8_e4m3 q_dtype=fp16"));

  // Scales: every layer at 1.0 per KV head on the FP8 server, none on bf16.
  const std::vector<LayerKvScales> scales = ScalesOf(*fp8.client);
  ASSERT_EQ(scales.size(), 2u);
  for (const LayerKvScales& l : scales) {
    EXPECT_EQ(l.k_scale, std::vector<float>(2, 1.f));
    EXPECT_EQ(l.v_scale, std::vector<float>(2, 1.f));
  }
  EXPECT_TRUE(ScalesOf(*bf16.client).empty());
  EXPECT_EQ(bf16.server->Stop(), 0);
  EXPECT_EQ(fp8.server->Stop(), 0);
}

// The quantizer's cases, the dtype pairs and both formats.
struct Fp8Config {
  std::string kv_dtype, q_dtype;
  int32_t page_size;
};

class Fp8RowsTest : public ::testing::TestWithParam<Fp8Config> {};

TEST_P(Fp8RowsTest, WritesQuantizeReadsReturnStoredOrDequantizedRows) {
  Fp8Server s = StartServer(GetParam().kv_dtype, GetParam().q_dtype, GetParam().page_size);
  ASSERT_TRUE(s.client);
  const KvGeometry& g = s.geo;
  ASSERT_TRUE(g.KvIsFp8());
  std::mt19937_64 gen(11);
  // Per-head scales on layer 1, one value for layer 0.
  const std::vector<float> l1_k = {0.02f, 0.05f}, l1_v = {0.5f, 0.125f};
  ASSERT_TRUE(s.client->SetKvScales({{1, l1_k, l1_v}, {0, {0.25f}, {3.f}}}).ok());
  const std::vector<LayerKvScales> scales = ScalesOf(*s.client);
  ASSERT_EQ(scales.size(), 2u);
  EXPECT_EQ(scales[0].k_scale, std::vector<float>(2, 0.25f));
  EXPECT_EQ(scales[0].v_scale, std::vector<float>(2, 3.f));
  EXPECT_EQ(scales[1].k_scale, l1_k);
  EXPECT_EQ(scales[1].v_scale, l1_v);

  auto pages = s.client->AllocatePages(2);
  ASSERT_TRUE(pages.ok()) << pages.status();
  const std::vector<int64_t> slots = SlotsOfPages(g, *pages);
  const int64_t n = static_cast<int64_t>(slots.size()) * g.RowElems();
  // Values around the scales, beyond the largest finite value (saturating)
  // and special ones.
  std::vector<uint16_t> k = RandomHalves(gen, g.dtype, n, 3.0);
  std::vector<uint16_t> v = RandomHalves(gen, g.dtype, n, 30.0);
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {inf, -inf, 1e4f, -1e4f, 0.f, -0.f, 1e-6f, -1e-6f};
  for (size_t i = 0; i < std::size(specials); ++i) k[i * 7] = FloatToHalf(g.dtype, specials[i]);
  ASSERT_TRUE(s.client->WriteKV(1, slots, k, v).ok());
  auto stored = s.client->ReadKV(1, slots);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_TRUE(stored->k.empty());
  EXPECT_EQ(stored->k_fp8, Quantize(g, k, l1_k));
  EXPECT_EQ(stored->v_fp8, Quantize(g, v, l1_v));
  for (uint8_t b : stored->k_fp8) EXPECT_FALSE(std::isnan(Fp8ToFloat(g.kv_fp8, b)));

  auto values = s.client->ReadKV(1, slots, /*dequantize=*/true);
  ASSERT_TRUE(values.ok()) << values.status();
  ASSERT_EQ(values->k.size(), k.size());
  EXPECT_TRUE(values->k_fp8.empty());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t head = (i % g.RowElems()) / g.head_dim;
    ASSERT_EQ(values->k[i],
              FloatToHalf(g.dtype, Fp8ToFloat(g.kv_fp8, stored->k_fp8[i]) * l1_k[head]));
    ASSERT_EQ(values->v[i],
              FloatToHalf(g.dtype, Fp8ToFloat(g.kv_fp8, stored->v_fp8[i]) * l1_v[head]));
  }

  // FP8 rows are stored as they are (every non-NaN byte), on layer 0.
  std::vector<uint8_t> k8(n), v8(n);
  for (int64_t i = 0; i < n; ++i) {
    k8[i] = static_cast<uint8_t>(i % 256);
    v8[i] = static_cast<uint8_t>((i * 7 + 3) % 256);
  }
  ASSERT_TRUE(s.client->WriteKVFp8(0, slots, k8, v8).ok());
  stored = s.client->ReadKV(0, slots);
  ASSERT_TRUE(stored.ok());
  EXPECT_EQ(stored->k_fp8, k8);
  EXPECT_EQ(stored->v_fp8, v8);
  EXPECT_EQ(s.server->Stop(), 0);
}

// Prefill over FP8 pools filled by WriteKV (16-bit and FP8 rows) and by
// fused appends (both kinds too), with and without a plan, against the
// reference over the dequantized values.
TEST_P(Fp8RowsTest, PrefillMatchesTheReferenceOverDequantizedValues) {
  Fp8Server s = StartServer(GetParam().kv_dtype, GetParam().q_dtype, GetParam().page_size);
  ASSERT_TRUE(s.client);
  const KvGeometry& g = s.geo;
  std::mt19937_64 gen(5);
  ASSERT_TRUE(s.client->SetKvScales({{0, {0.01f, 0.03f}, {0.02f, 0.004f}}}).ok());
  KvMirror mirror(g);
  ASSERT_TRUE(MirrorServerScales(*s.client, &mirror).ok());
  auto pages = s.client->AllocatePages(g.page_size == 1 ? 400 : 30);
  ASSERT_TRUE(pages.ok());
  // Half the pages by 16-bit rows, half by FP8 rows quantized here.
  const size_t half = pages->size() / 2;
  FillPages(*s.client, mirror, gen, 0, absl::MakeConstSpan(*pages).subspan(0, half));
  {
    const std::vector<int64_t> slots = SlotsOfPages(g, absl::MakeConstSpan(*pages).subspan(half));
    const int64_t n = static_cast<int64_t>(slots.size()) * g.RowElems();
    const auto k = RandomHalves(gen, g.dtype, n), v = RandomHalves(gen, g.dtype, n);
    mirror.Write(0, slots, k, v);
    std::vector<uint8_t> k8(n), v8(n);
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(k8.data() + i * g.RowElems(), mirror.StoredK(0, slots[i]), g.RowElems());
      std::memcpy(v8.data() + i * g.RowElems(), mirror.StoredV(0, slots[i]), g.RowElems());
    }
    ASSERT_TRUE(s.client->WriteKVFp8(0, slots, k8, v8).ok());
  }
  for (bool causal : {true, false}) {
    PrefillInputs in = EdgeCaseInputs(gen, g, *pages, 0, causal, !causal);
    auto out = s.client->Prefill(ArgsOf(in));
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectMatchesReference(mirror, in, *out);
  }

  // Fused appends: a decode step of 3 sequences, 16-bit rows, then FP8 rows,
  // through a plan the second time.
  auto fresh = s.client->AllocatePages(3);
  ASSERT_TRUE(fresh.ok());
  std::vector<int64_t> append_slots;
  for (int32_t p : *fresh) append_slots.push_back(int64_t{p} * g.page_size);
  PrefillInputs in;
  in.layer = 0;
  in.qo_indptr = {0, 1, 2, 3};
  in.kv_indptr = {0, 1, 2, 3};
  in.kv_indices = *fresh;
  in.kv_last_page_len = {1, 1, 1};
  in.q = RandomHalves(gen, g.dtype, 3 * g.num_qo_heads * g.head_dim);
  const int64_t rows = 3 * g.RowElems();
  const auto k = RandomHalves(gen, g.dtype, rows), v = RandomHalves(gen, g.dtype, rows);
  PrefillArgs args = ArgsOf(in);
  args.append_slots = append_slots;
  args.append_k = k;
  args.append_v = v;
  auto out = s.client->Prefill(args);
  ASSERT_TRUE(out.ok()) << out.status();
  mirror.Write(0, append_slots, k, v);
  ExpectMatchesReference(mirror, in, *out);

  PlanLayout layout;
  layout.qo_indptr = in.qo_indptr;
  layout.kv_indptr = in.kv_indptr;
  layout.kv_indices = in.kv_indices;
  layout.kv_last_page_len = in.kv_last_page_len;
  layout.append_slots = append_slots;
  auto plan = s.client->CreatePlan(layout);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto k2 = RandomHalves(gen, g.dtype, rows), v2 = RandomHalves(gen, g.dtype, rows);
  mirror.Write(0, append_slots, k2, v2);
  std::vector<uint8_t> k8(rows), v8(rows);
  for (size_t i = 0; i < append_slots.size(); ++i) {
    std::memcpy(k8.data() + i * g.RowElems(), mirror.StoredK(0, append_slots[i]), g.RowElems());
    std::memcpy(v8.data() + i * g.RowElems(), mirror.StoredV(0, append_slots[i]), g.RowElems());
  }
  PrefillArgs planned;
  planned.layer = 0;
  planned.q = in.q;
  planned.plan_id = *plan;
  planned.append_k_fp8 = k8;
  planned.append_v_fp8 = v8;
  out = s.client->Prefill(planned);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatchesReference(mirror, in, *out);
  auto back = s.client->ReadKV(0, append_slots);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->k_fp8, k8);
  EXPECT_EQ(s.server->Stop(), 0);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Fp8RowsTest,
                         ::testing::Values(Fp8Config{"fp8_e4m3", "", 16},
                                           Fp8Config{"fp8_e4m3", "fp16", 1},
                                           Fp8Config{"fp8_e5m2", "bf16", 16}),
                         [](const ::testing::TestParamInfo<Fp8Config>& info) {
                           std::string name = info.param.kv_dtype + "_q" +
                                              (info.param.q_dtype.empty() ? "default"
                                                                          : info.param.q_dtype) +
                                              "_ps" + std::to_string(info.param.page_size);
                           for (char& c : name) c = c == '_' ? 'X' : c;
                           return name;
                         });

// The tools' reference for a server that rounds queries
// (ServerInfo.fp8_query_min_rows, --prefill_kernel=sm90_fp8q on a GPU): the
// sequences of at least that many rows come out as the reference over their
// queries rounded (reference::RoundQueryRowToE4m3), the shorter ones as over
// the queries as sent, and the rounding moves the long ones' outputs; their
// LSEs are held to the FP8-query kernel's bound, the others' to every
// kernel's (Compare with ReferencePrefill's lse_bound).
TEST(Fp8ServerTest, ReferenceRoundsTheQueriesOfTheSequencesTheServerRounds) {
  KvGeometry g;
  g.num_layers = 1;
  g.num_pages = 64;
  g.page_size = 16;
  g.num_qo_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.dtype = KvDType::kBf16;
  g.kv_fp8 = Fp8Format::kE4m3;
  KvMirror mirror(g);
  std::mt19937_64 gen(5150);
  std::vector<int32_t> pages(g.num_pages);
  for (int32_t p = 0; p < g.num_pages; ++p) pages[p] = p;
  const std::vector<int64_t> slots = SlotsOfPages(g, pages);
  const auto k = RandomHalves(gen, g.dtype, static_cast<int64_t>(slots.size()) * g.RowElems());
  const auto v = RandomHalves(gen, g.dtype, static_cast<int64_t>(slots.size()) * g.RowElems());
  mirror.Write(0, slots, k, v);
  WorkloadSpec spec;
  spec.batch = 8;
  spec.max_q_len = 24;
  spec.max_kv_len = 100;
  PrefillInputs in = RandomPrefill(gen, g, spec, pages);
  constexpr int32_t kMinRows = 9;
  PrefillInputs rounded = in;
  int long_seqs = 0, short_seqs = 0;
  const int64_t row_heads = g.num_qo_heads;
  for (size_t b = 0; b + 1 < in.qo_indptr.size(); ++b) {
    const int64_t q_len = in.qo_indptr[b + 1] - in.qo_indptr[b];
    if (q_len == 0) continue;
    (q_len >= kMinRows ? long_seqs : short_seqs) += 1;
    if (q_len < kMinRows) continue;
    for (int64_t r = in.qo_indptr[b] * row_heads; r < in.qo_indptr[b + 1] * row_heads; ++r) {
      reference::RoundQueryRowToE4m3(g.dtype, rounded.q.data() + r * g.head_dim, g.head_dim);
    }
  }
  ASSERT_GT(long_seqs, 0);
  ASSERT_GT(short_seqs, 0);
  std::vector<double> o_plain, lse_plain, o_pre, lse_pre, o_got, lse_got;
  ReferencePrefill(mirror, in, &o_plain, &lse_plain);
  ReferencePrefill(mirror, rounded, &o_pre, &lse_pre);
  ReferencePrefill(mirror, in, &o_got, &lse_got, kMinRows);
  EXPECT_EQ(o_got, o_pre);
  EXPECT_EQ(lse_got, lse_pre);
  EXPECT_NE(o_got, o_plain);
  // The short sequences' rows are as over the queries as sent.
  for (size_t b = 0; b + 1 < in.qo_indptr.size(); ++b) {
    if (in.qo_indptr[b + 1] - in.qo_indptr[b] >= kMinRows) continue;
    for (int64_t r = in.qo_indptr[b] * row_heads; r < in.qo_indptr[b + 1] * row_heads; ++r) {
      EXPECT_EQ(lse_got[r], lse_plain[r]) << "row " << r;
    }
  }
  // The LSE bounds the tools compare with: the rounded rows' are the
  // FP8-query kernel's (its tensor cores' sums), at least kFp8QueryLseBound
  // and growing with the logits: with the queries twice as large (the
  // rounding is exact under a power of two) a bound past that floor doubles.
  // The others are every kernel's.
  std::vector<double> o_b, lse_b, bound, none, o2, lse2, bound2;
  ReferencePrefill(mirror, in, &o_b, &lse_b, kMinRows, &bound);
  ReferencePrefill(mirror, in, &o_b, &lse_b, 0, &none);
  PrefillInputs twice = in;
  for (uint16_t& x : twice.q) x = FloatToHalf(g.dtype, 2.f * HalfToFloat(g.dtype, x));
  ReferencePrefill(mirror, twice, &o2, &lse2, kMinRows, &bound2);
  ASSERT_EQ(bound.size(), lse_b.size());
  ASSERT_EQ(bound2.size(), lse_b.size());
  ASSERT_EQ(none, std::vector<double>(lse_b.size(), reference::kLseBound));
  int64_t long_row = -1, short_row = -1;
  int past_floor = 0;
  for (size_t b = 0; b + 1 < in.qo_indptr.size(); ++b) {
    const bool rounds = in.qo_indptr[b + 1] - in.qo_indptr[b] >= kMinRows;
    for (int64_t r = in.qo_indptr[b] * row_heads; r < in.qo_indptr[b + 1] * row_heads; ++r) {
      if (!rounds || !std::isfinite(lse_b[r])) {
        EXPECT_EQ(bound[r], reference::kLseBound) << "row " << r;
        if (!rounds) short_row = r;
        continue;
      }
      EXPECT_GE(bound[r], reference::kFp8QueryLseBound) << "row " << r;
      if (bound[r] > reference::kFp8QueryLseBound) {
        ++past_floor;
        EXPECT_DOUBLE_EQ(bound2[r], 2 * bound[r]) << "row " << r;
      } else {
        EXPECT_GE(bound2[r], bound[r]) << "row " << r;
      }
      long_row = r;
    }
  }
  EXPECT_GT(past_floor, 0);
  ASSERT_GE(long_row, 0);
  ASSERT_GE(short_row, 0);
  // Compare holds each row to its own bound: an LSE 2e-3 off (or half its
  // bound) passes on a rounded row and fails on another; one and a half
  // times a rounded row's bound fails there.
  const std::vector<uint16_t> o16 = [&] {
    std::vector<uint16_t> o(o_got.size());
    for (size_t i = 0; i < o.size(); ++i) o[i] = FloatToHalf(g.dtype, static_cast<float>(o_got[i]));
    return o;
  }();
  auto lse_off = [&](int64_t row, double by) {
    std::vector<float> lse(lse_got.begin(), lse_got.end());
    lse[row] = static_cast<float>(lse_got[row] + by);
    return lse;
  };
  EXPECT_TRUE(Compare(g.dtype, o_got, lse_got, o16, lse_off(long_row, 0), bound).Ok(g.dtype));
  EXPECT_TRUE(Compare(g.dtype, o_got, lse_got, o16, lse_off(long_row, 2e-3), bound).Ok(g.dtype));
  const Comparison short_off = Compare(g.dtype, o_got, lse_got, o16, lse_off(short_row, 2e-3), bound);
  EXPECT_FALSE(short_off.Ok(g.dtype));
  EXPECT_EQ(short_off.lse_over_bound, 1);
  EXPECT_NE(short_off.ToString().find("lse_rows_over_bound=1"), std::string::npos) << short_off.ToString();
  EXPECT_TRUE(Compare(g.dtype, o_got, lse_got, o16, lse_off(long_row, 0.5 * bound[long_row]), bound).Ok(g.dtype));
  EXPECT_FALSE(Compare(g.dtype, o_got, lse_got, o16, lse_off(long_row, 1.5 * bound[long_row]), bound).Ok(g.dtype));
  EXPECT_FALSE(Compare(g.dtype, o_got, lse_got, o16, lse_off(long_row, 2e-3)).Ok(g.dtype));
}

// Every bad input is INVALID_ARGUMENT naming the field; nothing stored, and
// no scale, changes.
TEST(Fp8ServerTest, BadInputsNameTheFieldAndChangeNothing) {
  Fp8Server fp8 = StartServer("fp8_e4m3", "");
  Fp8Server bf16 = StartServer("bf16", "");
  ASSERT_TRUE(fp8.client && bf16.client);
  const KvGeometry& g = fp8.geo;
  std::mt19937_64 gen(2);
  auto pages = fp8.client->AllocatePages(1);
  auto bf16_pages = bf16.client->AllocatePages(1);
  ASSERT_TRUE(pages.ok() && bf16_pages.ok());
  const std::vector<int64_t> slots = SlotsOfPages(g, *pages);
  const int64_t n = static_cast<int64_t>(slots.size()) * g.RowElems();
  ASSERT_TRUE(fp8.client->SetKvScales({{0, {0.5f}, {0.25f}}}).ok());
  ASSERT_TRUE(fp8.client->WriteKV(0, slots, RandomHalves(gen, g.dtype, n),
                                  RandomHalves(gen, g.dtype, n))
                  .ok());
  auto before = fp8.client->ReadKV(0, slots);
  ASSERT_TRUE(before.ok());
  const std::vector<LayerKvScales> scales_before = ScalesOf(*fp8.client);
  auto expect_invalid = [&](const absl::Status& s, const std::string& field) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(field)) << s;
    auto after = fp8.client->ReadKV(0, slots);
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(after->k_fp8, before->k_fp8) << field;
    EXPECT_EQ(after->v_fp8, before->v_fp8) << field;
    EXPECT_TRUE(SameScales(ScalesOf(*fp8.client), scales_before)) << field;
  };
  auto set = [&](std::vector<LayerKvScales> layers) { return fp8.client->SetKvScales(layers); };
  const float inf = std::numeric_limits<float>::infinity();
  expect_invalid(set({{0, {0.f}, {1.f}}}), "layers[0].k_scale[0]=0");
  expect_invalid(set({{1, {1.f}, {-1.f}}}), "layers[0].v_scale[0]=-1");
  expect_invalid(set({{0, {inf}, {1.f}}}), "layers[0].k_scale[0]=inf");
  expect_invalid(set({{0, {std::nanf("")}, {1.f}}}), "layers[0].k_scale[0]=nan");
  expect_invalid(set({{0, {1.f, 2.f}, {1.f}}, {1, {1.f}, {1e31f}}}), "layers[1].v_scale[0]");
  // K's bound is lower: |sm_scale| (<= 1e30) x k_scale x log2(e) stays a
  // finite float (1e19 x 1e20 overflowed and was clamped: wrong logits).
  expect_invalid(set({{0, {1e20f}, {1.f}}}), "layers[0].k_scale[0]=1e+20 must be finite and in (0, 1e+08]");
  expect_invalid(set({{0, {1.f, 1.5e8f}, {1.f}}}), "layers[0].k_scale[1]=1.5e+08");
  expect_invalid(set({{2, {1.f}, {1.f}}}), "layers[0].layer=2 out of range [0, 2)");
  expect_invalid(set({{-1, {1.f}, {1.f}}}), "layers[0].layer=-1");
  // Past num_kv_heads the wire limit answers before parsing, with the same bound.
  expect_invalid(set({{0, {1.f, 2.f, 3.f}, {1.f}}}), "layers[0].k_scale has more than 2 entries (num_kv_heads=2)");
  expect_invalid(set({{0, {}, {1.f}}}), "layers[0].k_scale has 0 entries");
  expect_invalid(set({{1, {1.f}, {1.f}}, {1, {2.f}, {2.f}}}), "layers[1].layer=1 is repeated");
  expect_invalid(set({}), "layers is empty");
  // A valid layer beside a bad one changes nothing either.
  expect_invalid(set({{1, {3.f}, {3.f}}, {0, {1.f}, {0.f}}}), "layers[1].v_scale[0]=0");
  // Rows of another FP8 format, of mixed dtypes, of a wrong size.
  std::vector<uint8_t> k8(n, 0x38), v8(n, 0x38);
  v1::WriteKVRequest w;
  w.set_layer(0);
  w.mutable_slots()->Add(slots.begin(), slots.end());
  const std::vector<int64_t> shape = {static_cast<int64_t>(slots.size()), g.num_kv_heads,
                                      g.head_dim};
  auto write = [&](v1::DType k_dtype, v1::DType v_dtype, size_t k_bytes) {
    v1::WriteKVRequest r = w;
    SetTensor(r.mutable_k(), k_dtype, shape, k8.data(), k_bytes);
    SetTensor(r.mutable_v(), v_dtype, shape, v8.data(), n);
    grpc::ClientContext ctx;
    fp8.client->PrepareContext(&ctx);
    v1::WriteKVResponse resp;
    return Client::FromGrpc(fp8.client->stub()->WriteKV(&ctx, r, &resp));
  };
  expect_invalid(write(v1::DTYPE_FP8_E5M2, v1::DTYPE_FP8_E5M2, n),
                 "k.dtype=DTYPE_FP8_E5M2 must be DTYPE_BF16 (quantized by the server) or "
                 "DTYPE_FP8_E4M3");
  expect_invalid(write(v1::DTYPE_FP8_E4M3, v1::DTYPE_BF16, n),
                 "v.dtype=DTYPE_BF16 must equal k.dtype=DTYPE_FP8_E4M3");
  expect_invalid(write(v1::DTYPE_FP8_E4M3, v1::DTYPE_FP8_E4M3, n - 1), "k.data has");
  expect_invalid(write(v1::DTYPE_FP32, v1::DTYPE_FP32, n), "k.dtype=DTYPE_FP32");

  // FP8 rows, and scales, to a bf16 server.
  const std::vector<int64_t> bf16_slots = SlotsOfPages(bf16.geo, *bf16_pages);
  absl::Status s = bf16.client->WriteKVFp8(0, bf16_slots, k8, v8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("k.dtype=DTYPE_FP8_E4M3: this server's KV cache is DTYPE_BF16"));
  PrefillInputs in;
  in.qo_indptr = {0, 1};
  in.kv_indptr = {0, 1};
  in.kv_indices = {(*bf16_pages)[0]};
  in.kv_last_page_len = {1};
  in.q = RandomHalves(gen, bf16.geo.dtype, bf16.geo.num_qo_heads * bf16.geo.head_dim);
  const std::vector<int64_t> one_slot = {int64_t{(*bf16_pages)[0]} * bf16.geo.page_size};
  const std::vector<uint8_t> row8(bf16.geo.RowElems(), 0x38);
  // By hand: the client labels FP8 rows with the server's kv_dtype.
  v1::PrefillRequest p = PrefillProto(bf16.geo, in, one_slot,
                                      std::vector<uint16_t>(bf16.geo.RowElems()),
                                      std::vector<uint16_t>(bf16.geo.RowElems()));
  for (v1::Tensor* t : {p.mutable_append_k(), p.mutable_append_v()}) {
    t->set_dtype(v1::DTYPE_FP8_E4M3);
    t->set_data(row8.data(), row8.size());
  }
  {
    grpc::ClientContext ctx;
    bf16.client->PrepareContext(&ctx);
    v1::PrefillResponse resp;
    s = Client::FromGrpc(bf16.client->stub()->Prefill(&ctx, p, &resp));
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("append_k.dtype=DTYPE_FP8_E4M3"));
  s = bf16.client->SetKvScales({{0, {0.5f}, {0.5f}}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("KV scales apply to an FP8 KV cache"));

  // A stale incarnation changes no scale.
  v1::SetKvScalesRequest stale;
  stale.set_expected_incarnation(fp8.client->incarnation() ^ 1);
  v1::LayerKvScales* l = stale.add_layers();
  l->set_layer(0);
  l->add_k_scale(7.f);
  l->add_v_scale(7.f);
  {
    grpc::ClientContext ctx;
    fp8.client->PrepareContext(&ctx);
    v1::SetKvScalesResponse resp;
    s = Client::FromGrpc(fp8.client->stub()->SetKvScales(&ctx, stale, &resp));
  }
  EXPECT_TRUE(IsStaleIncarnation(s)) << s;
  EXPECT_TRUE(SameScales(ScalesOf(*fp8.client), scales_before));
  EXPECT_EQ(fp8.server->Stop(), 0);
  EXPECT_EQ(bf16.server->Stop(), 0);
}

// Scales are the server's: a change is refused while another tenant holds
// pages (its KV was quantized with the scales in force); setting the values
// in force is always allowed; a restart starts again at 1.0, as it starts
// with an empty cache.
TEST(Fp8ServerTest, ScalesAreTheServersAndDoNotSurviveARestart) {
  auto tokens = WriteTokensFile("tok-alice alice\ntok-bob bob\n");
  ASSERT_TRUE(tokens.ok());
  Fp8Server s = StartServer("fp8_e4m3", "", 16, {"--auth_tokens_file=" + *tokens}, "tok-alice");
  ASSERT_TRUE(s.server);
  std::unique_ptr<Client> alice = std::move(s.client);
  auto bob = Connect(*s.server, "tok-bob");
  ASSERT_TRUE(alice && bob);
  ASSERT_TRUE(alice->SetKvScales({{0, {0.5f}, {0.5f}}}).ok());
  auto bob_pages = bob->AllocatePages(1);
  ASSERT_TRUE(bob_pages.ok());
  absl::Status st = alice->SetKvScales({{0, {0.25f}, {0.5f}}});
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("other tenants hold (1 pages)"));
  EXPECT_EQ(ScalesOf(*alice)[0].k_scale, std::vector<float>(2, 0.5f));
  EXPECT_TRUE(alice->SetKvScales({{0, {0.5f}, {0.5f}}}).ok());  // no change
  // Alice's own pages do not stop her.
  auto alice_pages = alice->AllocatePages(1);
  ASSERT_TRUE(alice_pages.ok());
  ASSERT_TRUE(bob->FreePages(*bob_pages).ok());
  EXPECT_TRUE(alice->SetKvScales({{0, {0.25f}, {0.5f}}}).ok());
  EXPECT_EQ(ScalesOf(*bob)[0].k_scale, std::vector<float>(2, 0.25f));

  // A restart on the same address: an empty cache and every scale 1.0.
  const std::string address = s.server->grpc_address();
  const uint64_t incarnation = alice->incarnation();
  alice.reset();
  bob.reset();
  ASSERT_EQ(s.server->Stop(), 0);
  Fp8Server again = StartServer("fp8_e4m3", "", 16,
                                {"--auth_tokens_file=" + *tokens, "--listen=" + address},
                                "tok-alice");
  ASSERT_TRUE(again.server);
  std::unique_ptr<Client> alice2 = std::move(again.client);
  ASSERT_TRUE(alice2);
  EXPECT_NE(alice2->incarnation(), incarnation);
  EXPECT_EQ(ScalesOf(*alice2)[0].k_scale, std::vector<float>(2, 1.f));
  EXPECT_EQ(again.server->Stop(), 0);
  unlink(tokens->c_str());
}

}  // namespace
}  // namespace server_test
}  // namespace attnserve
