// Integration tests: the real attnserve binary (CPU backend) on a free port,
// driven through the C++ client (client/client.h) and hand-made protos.
//
// Results are checked against the float64 reference of common/reference.h
// with docs/design.md's tolerances; errors by their gRPC code and a message that
// names the field; batching by the server's own Prometheus metrics.
#include <unistd.h>

#include <algorithm>
#include <set>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "client/workload.h"
#include "common/dtype.h"
#include "common/reference.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

#ifndef ATTNCTL_BIN
#error "ATTNCTL_BIN must name the attnctl binary"
#endif

namespace attnserve {
namespace {

using ::testing::HasSubstr;

constexpr float kNegInfF = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------ helpers

// Prefills answered OK, decode and prefill shapes together.
double OkPrefills(const std::string& metrics) {
  double n = 0;
  for (const char* shape : {"decode", "prefill"}) {
    n += MetricValue(metrics, "attnserve_requests_total",
                     absl::StrCat("code=\"OK\",method=\"Prefill\",shape=\"", shape, "\""))
             .value_or(0);
  }
  return n;
}


std::unique_ptr<Client> Connect(const TestServer& server, const std::string& token = "") {
  ClientOptions options;
  options.target = server.grpc_address();
  options.token = token;
  options.timeout_s = 120;  // a hung server fails the test instead of hanging it
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// Writes random K/V into every slot of `pages` in `layer`, and into the mirror.
void FillPages(Client& client, KvMirror& mirror, std::mt19937_64& gen, int32_t layer,
               absl::Span<const int32_t> pages) {
  const KvGeometry& g = mirror.geometry();
  const std::vector<int64_t> slots = SlotsOfPages(g, pages);
  const int64_t n = static_cast<int64_t>(slots.size()) * g.RowElems();
  const std::vector<uint16_t> k = RandomHalves(gen, g.dtype, n), v = RandomHalves(gen, g.dtype, n);
  absl::Status s = client.WriteKV(layer, slots, k, v);
  ASSERT_TRUE(s.ok()) << s;
  mirror.Write(layer, slots, k, v);
}

// A ragged batch with every edge case: an empty sequence, one without pages,
// one with nothing at all, more rows than KV tokens (a partial last page),
// an exactly full last page, a decode row, plus random sequences; page ids
// drawn with replacement from `pages` (repeated, in any order).
PrefillInputs EdgeCaseInputs(std::mt19937_64& gen, const KvGeometry& g,
                             absl::Span<const int32_t> pages, int32_t layer, bool causal,
                             bool lse_base_e, int random_seqs = 4, int32_t max_q = 40,
                             int32_t max_kv = 160) {
  const int32_t ps = g.page_size;
  std::uniform_int_distribution<int32_t> q_dist(1, max_q), kv_dist(1, max_kv);
  std::vector<std::pair<int32_t, int32_t>> lens = {
      {0, kv_dist(gen)},
      {q_dist(gen), 0},
      {0, 0},
      {ps + ps / 2 + 1 + 1 + q_dist(gen) % 6, ps + ps / 2 + 1},
      {q_dist(gen), std::max(1, max_kv / ps) * ps},
      {1, kv_dist(gen)},
  };
  for (int i = 0; i < random_seqs; ++i) lens.emplace_back(q_dist(gen), kv_dist(gen));
  std::shuffle(lens.begin(), lens.end(), gen);
  std::uniform_int_distribution<size_t> page_dist(0, pages.size() - 1);
  PrefillInputs in;
  in.layer = layer;
  in.causal = causal;
  in.lse_base_e = lse_base_e;
  in.qo_indptr = {0};
  in.kv_indptr = {0};
  for (auto [q_len, kv_len] : lens) {
    const int32_t num_pages = (kv_len + ps - 1) / ps;
    for (int32_t p = 0; p < num_pages; ++p) in.kv_indices.push_back(pages[page_dist(gen)]);
    in.qo_indptr.push_back(in.qo_indptr.back() + q_len);
    in.kv_indptr.push_back(in.kv_indptr.back() + num_pages);
    in.kv_last_page_len.push_back(num_pages == 0 ? 0 : kv_len - (num_pages - 1) * ps);
  }
  in.q = RandomHalves(gen, g.dtype, in.total_q() * g.num_qo_heads * g.head_dim);
  return in;
}


// Checks a Prefill result against the float64 reference: docs/design.md's
// tolerances, and rows that see nothing exactly 0 with LSE -inf. Returns the
// number of (row, head) pairs that see nothing.
int64_t ExpectMatchesReference(const KvMirror& mirror, const PrefillInputs& in,
                               const PrefillResult& out) {
  const KvGeometry& g = mirror.geometry();
  std::vector<double> o_ref, lse_ref;
  ReferencePrefill(mirror, in, &o_ref, &lse_ref);
  EXPECT_EQ(out.o.size(), o_ref.size());
  EXPECT_EQ(out.lse.size(), lse_ref.size());
  if (out.o.size() != o_ref.size() || out.lse.size() != lse_ref.size()) return 0;
  const Comparison c = Compare(g.dtype, o_ref, lse_ref, out.o, out.lse);
  EXPECT_TRUE(c.Ok(g.dtype)) << c.ToString();
  EXPECT_EQ(c.nan_count, 0);
  int64_t blind = 0;
  for (size_t r = 0; r < lse_ref.size(); ++r) {
    if (!std::isinf(lse_ref[r])) continue;
    ++blind;
    EXPECT_EQ(out.lse[r], kNegInfF) << "row " << r / g.num_qo_heads;
    for (int32_t c2 = 0; c2 < g.head_dim; ++c2) {
      if (HalfToFloat(g.dtype, out.o[r * g.head_dim + c2]) != 0.f) {
        ADD_FAILURE() << "row " << r / g.num_qo_heads << " sees nothing but o != 0";
        break;
      }
    }
  }
  return blind;
}

// Both tenants' K and V, read back, for byte-for-byte comparison.
struct Snapshot {
  std::vector<KvData> layers;
  bool operator==(const Snapshot& o) const {
    if (layers.size() != o.layers.size()) return false;
    for (size_t i = 0; i < layers.size(); ++i) {
      if (layers[i].k != o.layers[i].k || layers[i].v != o.layers[i].v) return false;
    }
    return true;
  }
};

Snapshot Read(Client& client, const KvGeometry& g, absl::Span<const int32_t> pages) {
  Snapshot s;
  const std::vector<int64_t> slots = SlotsOfPages(g, pages);
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    auto kv = client.ReadKV(layer, slots);
    EXPECT_TRUE(kv.ok()) << kv.status();
    s.layers.push_back(kv.ok() ? *std::move(kv) : KvData{});
  }
  return s;
}

// ------------------------------------------------------------ fixture

// One server per test, parametrized by page size (1 and 16).
class ServerTest : public ::testing::TestWithParam<int32_t> {
 protected:
  void SetUp() override {
    TestServerOptions options;
    options.page_size = GetParam();
    // Room for 16 concurrent clients' pages.
    options.num_pages = GetParam() == 1 ? 8192 : 1024;
    auto server = TestServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = Connect(*server_);
    ASSERT_NE(client_, nullptr);
    geo_ = GeometryOf(client_->info());
  }
  void TearDown() override {
    if (server_ == nullptr) return;
    client_.reset();
    EXPECT_EQ(server_->Stop(), 0) << "attnserve did not exit cleanly; its output:\n"
                                  << server_->Output();
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> client_;
  KvGeometry geo_;
};

std::string PageSizeName(const ::testing::TestParamInfo<int32_t>& info) {
  return absl::StrCat("PageSize", info.param);
}

INSTANTIATE_TEST_SUITE_P(PageSizes, ServerTest, ::testing::Values(1, 16), PageSizeName);

// ------------------------------------------------------------ every RPC

TEST_P(ServerTest, GetServerInfoReportsTheGeometry) {
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->version().empty());
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_FALSE(info->device().empty());
  EXPECT_EQ(info->num_layers(), 2);
  EXPECT_EQ(info->num_pages(), server_->options().num_pages);
  EXPECT_EQ(info->page_size(), GetParam());
  EXPECT_EQ(info->num_qo_heads(), 8);
  EXPECT_EQ(info->num_kv_heads(), 2);
  EXPECT_EQ(info->head_dim(), 64);
  EXPECT_EQ(info->kv_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(info->free_pages(), info->num_pages());
  EXPECT_GT(info->max_batch_tokens(), 0);
  EXPECT_EQ(info->max_message_bytes(), 512ll << 20);
  EXPECT_NE(info->incarnation(), 0u);
}

TEST_P(ServerTest, HealthIsServingOverallAndForTheService) {
  EXPECT_TRUE(client_->Health("").ok());
  EXPECT_TRUE(client_->Health("attnserve.v1.AttentionService").ok());
  EXPECT_EQ(client_->Health("no.such.Service").code(), absl::StatusCode::kNotFound);
}

TEST_P(ServerTest, AllocateAndFreePages) {
  const int32_t total = geo_.num_pages;
  auto a = client_->AllocatePages(5);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->size(), 5u);
  for (int32_t p : *a) {
    EXPECT_GE(p, 0);
    EXPECT_LT(p, total);
  }
  auto b = client_->AllocatePages(total - 5);
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<int32_t> all = *a;
  all.insert(all.end(), b->begin(), b->end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::unique(all.begin(), all.end()), all.end()) << "a page was handed out twice";
  EXPECT_EQ(client_->GetServerInfo()->free_pages(), 0);
  // No pages left.
  auto none = client_->AllocatePages(1);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted) << none.status();
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("count"));
  ASSERT_TRUE(client_->FreePages(*b).ok());
  EXPECT_EQ(client_->GetServerInfo()->free_pages(), total - 5);
  // A freed page is nobody's: freeing it again is refused.
  EXPECT_EQ(client_->FreePages({(*b)[0]}).code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(client_->FreePages(*a).ok());
  EXPECT_EQ(client_->GetServerInfo()->free_pages(), total);
}

TEST_P(ServerTest, AllocatePagesReturnsTheIncarnation) {
  v1::AllocatePagesRequest req;
  req.set_count(2);
  v1::AllocatePagesResponse resp;
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  ASSERT_TRUE(client_->stub()->AllocatePages(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.page_ids_size(), 2);
  EXPECT_EQ(resp.incarnation(), client_->info().incarnation());
}

TEST_P(ServerTest, ReadKvReturnsExactlyWhatWriteKvWrote) {
  std::mt19937_64 gen(GetParam() + 100);
  auto pages = client_->AllocatePages(GetParam() == 1 ? 40 : 4);
  ASSERT_TRUE(pages.ok()) << pages.status();
  std::vector<int64_t> slots = SlotsOfPages(geo_, *pages);
  std::shuffle(slots.begin(), slots.end(), gen);
  slots.resize(slots.size() * 3 / 4);
  const int64_t row = geo_.RowElems();
  const int64_t n = static_cast<int64_t>(slots.size());
  // Different data in each layer at the same slots.
  std::vector<std::vector<uint16_t>> k(2), v(2);
  for (int32_t layer = 0; layer < 2; ++layer) {
    k[layer] = RandomHalves(gen, geo_.dtype, n * row);
    v[layer] = RandomHalves(gen, geo_.dtype, n * row);
    ASSERT_TRUE(client_->WriteKV(layer, slots, k[layer], v[layer]).ok());
  }
  for (int32_t layer = 0; layer < 2; ++layer) {
    auto back = client_->ReadKV(layer, slots);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(back->k == k[layer]) << "layer " << layer;
    EXPECT_TRUE(back->v == v[layer]) << "layer " << layer;
  }
  // Read in another order: rows follow the slots asked for.
  std::vector<int64_t> reversed(slots.rbegin(), slots.rend());
  auto back = client_->ReadKV(1, reversed);
  ASSERT_TRUE(back.ok()) << back.status();
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(std::equal(k[1].begin() + (n - 1 - i) * row, k[1].begin() + (n - i) * row,
                           back->k.begin() + i * row))
        << "row " << i;
  }
  // The raw response carries the documented shape and dtype.
  v1::ReadKVRequest req;
  req.set_layer(0);
  req.add_slots(slots[0]);
  v1::ReadKVResponse resp;
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  ASSERT_TRUE(client_->stub()->ReadKV(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.k().dtype(), v1::DTYPE_BF16);
  EXPECT_THAT(resp.k().shape(), ::testing::ElementsAre(1, 2, 64));
  EXPECT_THAT(resp.v().shape(), ::testing::ElementsAre(1, 2, 64));
}

// ------------------------------------------------------------ Prefill

TEST_P(ServerTest, RaggedBatchesWithEveryEdgeCaseMatchTheReference) {
  std::mt19937_64 gen(GetParam());
  KvMirror mirror(geo_);
  auto pages = client_->AllocatePages(GetParam() == 1 ? 300 : 24);
  ASSERT_TRUE(pages.ok()) << pages.status();
  for (int32_t layer = 0; layer < 2; ++layer) {
    ASSERT_NO_FATAL_FAILURE(FillPages(*client_, mirror, gen, layer, *pages));
  }
  struct Variant {
    int32_t layer;
    bool causal;
    bool lse_base_e;
    std::optional<float> sm_scale;
  };
  const Variant variants[] = {
      {0, true, false, std::nullopt},
      {1, true, true, std::nullopt},
      {0, false, false, std::nullopt},
      {1, false, true, 0.05f},
      {0, true, false, 0.3f},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(absl::StrCat("layer ", v.layer, v.causal ? " causal" : " non-causal",
                              v.lse_base_e ? " base e" : " base 2"));
    PrefillInputs in = EdgeCaseInputs(gen, geo_, *pages, v.layer, v.causal, v.lse_base_e);
    in.sm_scale = v.sm_scale;
    auto out = client_->Prefill(ArgsOf(in));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->incarnation, client_->info().incarnation());
    const int64_t blind = ExpectMatchesReference(mirror, in, *out);
    EXPECT_GT(blind, 0) << "the batch had no row that sees nothing";
  }
}

TEST_P(ServerTest, CausalDefaultsToTrueAndLseToBaseTwo) {
  std::mt19937_64 gen(7);
  KvMirror mirror(geo_);
  auto pages = client_->AllocatePages(GetParam() == 1 ? 64 : 4);
  ASSERT_TRUE(pages.ok());
  ASSERT_NO_FATAL_FAILURE(FillPages(*client_, mirror, gen, 0, *pages));
  PrefillInputs in = EdgeCaseInputs(gen, geo_, *pages, 0, true, false, 2, 20, 60);
  PrefillArgs args = ArgsOf(in);
  args.causal.reset();  // not sent: the server's default applies
  auto out = client_->Prefill(args);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatchesReference(mirror, in, *out);
}

TEST_P(ServerTest, ResponseTensorsCarryTheirShapes) {
  std::mt19937_64 gen(8);
  auto pages = client_->AllocatePages(2);
  ASSERT_TRUE(pages.ok());
  v1::PrefillRequest req;
  req.mutable_q()->set_dtype(v1::DTYPE_BF16);
  req.mutable_q()->add_shape(3);
  req.mutable_q()->add_shape(8);
  req.mutable_q()->add_shape(64);
  const std::vector<uint16_t> q = RandomHalves(gen, geo_.dtype, 3 * 8 * 64);
  req.mutable_q()->set_data(q.data(), q.size() * 2);
  for (int32_t x : {0, 3}) req.add_qo_indptr(x);
  for (int32_t x : {0, 1}) req.add_kv_indptr(x);
  req.add_kv_indices((*pages)[0]);
  req.add_kv_last_page_len(1);
  v1::PrefillResponse resp;
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  grpc::Status s = client_->stub()->Prefill(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.output().dtype(), v1::DTYPE_BF16);
  EXPECT_THAT(resp.output().shape(), ::testing::ElementsAre(3, 8, 64));
  EXPECT_EQ(resp.output().data().size(), 3u * 8 * 64 * 2);
  EXPECT_EQ(resp.lse().dtype(), v1::DTYPE_FP32);
  EXPECT_THAT(resp.lse().shape(), ::testing::ElementsAre(3, 8));
  EXPECT_EQ(resp.lse().data().size(), 3u * 8 * 4);
}

TEST_P(ServerTest, FusedAppendIsWrittenBeforeAttention) {
  // Chunked prefill: each sequence has a prefix in the cache and sends its
  // next tokens' K/V with the request; the new rows attend to them.
  std::mt19937_64 gen(GetParam() + 40);
  KvMirror mirror(geo_);
  const int32_t ps = geo_.page_size;
  const int32_t prefix[] = {37, 0, 16, 5};
  const int32_t chunk[] = {9, 12, 1, 30};
  PrefillInputs in;
  in.layer = 1;
  in.qo_indptr = {0};
  in.kv_indptr = {0};
  std::vector<int64_t> append_slots;
  std::vector<int32_t> all_pages;
  for (int b = 0; b < 4; ++b) {
    const int32_t kv_len = prefix[b] + chunk[b];
    const int32_t num_pages = (kv_len + ps - 1) / ps;
    auto pages = client_->AllocatePages(num_pages);
    ASSERT_TRUE(pages.ok()) << pages.status();
    std::reverse(pages->begin(), pages->end());  // out of order in the cache
    all_pages.insert(all_pages.end(), pages->begin(), pages->end());
    std::vector<int64_t> slots;
    for (int32_t j = 0; j < kv_len; ++j) {
      slots.push_back(int64_t{(*pages)[j / ps]} * ps + j % ps);
    }
    // The prefix through WriteKV, the chunk through the Prefill.
    std::vector<int64_t> prefix_slots(slots.begin(), slots.begin() + prefix[b]);
    if (!prefix_slots.empty()) {
      const int64_t n = static_cast<int64_t>(prefix_slots.size()) * geo_.RowElems();
      auto k = RandomHalves(gen, geo_.dtype, n), v = RandomHalves(gen, geo_.dtype, n);
      ASSERT_TRUE(client_->WriteKV(1, prefix_slots, k, v).ok());
      mirror.Write(1, prefix_slots, k, v);
    }
    append_slots.insert(append_slots.end(), slots.begin() + prefix[b], slots.end());
    in.kv_indices.insert(in.kv_indices.end(), pages->begin(), pages->end());
    in.qo_indptr.push_back(in.qo_indptr.back() + chunk[b]);
    in.kv_indptr.push_back(in.kv_indptr.back() + num_pages);
    in.kv_last_page_len.push_back(kv_len - (num_pages - 1) * ps);
  }
  in.q = RandomHalves(gen, geo_.dtype, in.total_q() * geo_.num_qo_heads * geo_.head_dim);
  const int64_t n_append = static_cast<int64_t>(append_slots.size());
  const auto ak = RandomHalves(gen, geo_.dtype, n_append * geo_.RowElems());
  const auto av = RandomHalves(gen, geo_.dtype, n_append * geo_.RowElems());
  PrefillArgs args = ArgsOf(in);
  args.append_slots = append_slots;
  args.append_k = ak;
  args.append_v = av;
  auto out = client_->Prefill(args);
  ASSERT_TRUE(out.ok()) << out.status();
  mirror.Write(1, append_slots, ak, av);
  ExpectMatchesReference(mirror, in, *out);
  // The appended rows stay in the cache, exactly.
  auto back = client_->ReadKV(1, append_slots);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->k == ak);
  EXPECT_TRUE(back->v == av);

  // Decode step: one new row per sequence, appended into the next slot.
  PrefillInputs decode = in;
  decode.qo_indptr = {0, 1, 2, 3, 4};
  std::vector<int64_t> next_slots;
  decode.kv_indices.clear();
  decode.kv_indptr = {0};
  decode.kv_last_page_len.clear();
  size_t page_at = 0;
  for (int b = 0; b < 4; ++b) {
    const int32_t kv_len = prefix[b] + chunk[b];
    const int32_t num_pages = (kv_len + ps - 1) / ps;
    std::vector<int32_t> seq_pages(in.kv_indices.begin() + page_at,
                                   in.kv_indices.begin() + page_at + num_pages);
    page_at += num_pages;
    if (kv_len % ps == 0) {  // the last page is full: the new token needs a page
      auto more = client_->AllocatePages(1);
      ASSERT_TRUE(more.ok());
      seq_pages.push_back((*more)[0]);
    }
    next_slots.push_back(int64_t{seq_pages[kv_len / ps]} * ps + kv_len % ps);
    decode.kv_indices.insert(decode.kv_indices.end(), seq_pages.begin(), seq_pages.end());
    decode.kv_indptr.push_back(decode.kv_indptr.back() + static_cast<int32_t>(seq_pages.size()));
    decode.kv_last_page_len.push_back(kv_len + 1 - (static_cast<int32_t>(seq_pages.size()) - 1) * ps);
  }
  decode.q = RandomHalves(gen, geo_.dtype, 4 * geo_.num_qo_heads * geo_.head_dim);
  const auto dk = RandomHalves(gen, geo_.dtype, 4 * geo_.RowElems());
  const auto dv = RandomHalves(gen, geo_.dtype, 4 * geo_.RowElems());
  PrefillArgs dargs = ArgsOf(decode);
  dargs.append_slots = next_slots;
  dargs.append_k = dk;
  dargs.append_v = dv;
  auto dout = client_->Prefill(dargs);
  ASSERT_TRUE(dout.ok()) << dout.status();
  mirror.Write(1, next_slots, dk, dv);
  EXPECT_EQ(ExpectMatchesReference(mirror, decode, *dout), 0);
}

TEST_P(ServerTest, ExpectedIncarnationIsChecked) {
  std::mt19937_64 gen(9);
  KvMirror mirror(geo_);
  auto pages = client_->AllocatePages(GetParam() == 1 ? 32 : 2);
  ASSERT_TRUE(pages.ok());
  ASSERT_NO_FATAL_FAILURE(FillPages(*client_, mirror, gen, 0, *pages));
  PrefillInputs in = EdgeCaseInputs(gen, geo_, *pages, 0, true, false, 1, 8, 30);
  PrefillArgs args = ArgsOf(in);
  args.expected_incarnation = client_->info().incarnation();
  auto out = client_->Prefill(args);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatchesReference(mirror, in, *out);
  args.expected_incarnation = client_->info().incarnation() ^ 1;
  auto stale = client_->Prefill(args);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_THAT(std::string(stale.status().message()), HasSubstr("expected_incarnation"));
}

// ------------------------------------------------------------ MergeStates

// The float64 merge of common/reference.h over the client's states.
void ReferenceMerge(const std::vector<State>& states, int64_t rows, int32_t d, KvDType dtype,
                    bool base_e, std::vector<double>* v, std::vector<double>* lse) {
  std::vector<reference::State> ref;
  for (const State& s : states) ref.push_back({s.v.data(), s.lse.data()});
  reference::Merge(dtype, ref, rows, d, base_e, v, lse);
}

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

// ------------------------------------------------------------ concurrency

TEST_P(ServerTest, ConcurrentClientsGetCorrectResultsInFewerBatchesThanRequests) {
  constexpr int kClients = 16, kRequestsEach = 4;
  auto metrics_before = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics_before.ok()) << metrics_before.status();
  const double batches_before =
      MetricValue(*metrics_before, "attnserve_batch_requests_count").value_or(0);
  const double requests_before =
      MetricValue(*metrics_before, "attnserve_batch_requests_sum").value_or(0);
  const double ok_before = OkPrefills(*metrics_before);

  // Every client first fills its own pages, then all send their requests at
  // once, so that requests arrive while earlier batches run.
  absl::Mutex mu;
  int ready = 0;
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      auto client = Connect(*server_);
      std::mt19937_64 gen(1000 + t);
      KvMirror mirror(geo_);
      WorkloadSpec spec;
      spec.batch = 3;
      spec.max_q_len = 48;
      spec.max_kv_len = 160;
      spec.layer = t % 2;
      spec.causal = t % 3 != 0;
      spec.lse_base_e = t % 4 == 0;
      absl::StatusOr<std::vector<int32_t>> pages =
          client ? client->AllocatePages(static_cast<int32_t>(PagesNeeded(geo_, spec)))
                 : absl::UnavailableError("no client");
      if (pages.ok()) {
        const std::vector<int64_t> slots = SlotsOfPages(geo_, *pages);
        const int64_t n = static_cast<int64_t>(slots.size()) * geo_.RowElems();
        auto k = RandomHalves(gen, geo_.dtype, n), v = RandomHalves(gen, geo_.dtype, n);
        absl::Status s = client->WriteKV(spec.layer, slots, k, v);
        if (!s.ok()) errors[t] = s.ToString();
        mirror.Write(spec.layer, slots, k, v);
      } else {
        errors[t] = pages.status().ToString();
      }
      {
        absl::MutexLock lock(&mu);
        ++ready;
        auto all_ready = [&] { return ready == kClients; };
        mu.Await(absl::Condition(&all_ready));
      }
      if (!errors[t].empty()) return;
      for (int i = 0; i < kRequestsEach; ++i) {
        PrefillInputs in = RandomPrefill(gen, geo_, spec, *pages);
        auto out = client->Prefill(ArgsOf(in));
        if (!out.ok()) {
          errors[t] = out.status().ToString();
          return;
        }
        std::vector<double> o_ref, lse_ref;
        ReferencePrefill(mirror, in, &o_ref, &lse_ref);
        const Comparison c = Compare(geo_.dtype, o_ref, lse_ref, out->o, out->lse);
        if (!c.Ok(geo_.dtype)) {
          errors[t] = absl::StrCat("request ", i, ": ", c.ToString());
          return;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kClients; ++t) EXPECT_EQ(errors[t], "") << "client " << t;

  auto metrics_after = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics_after.ok()) << metrics_after.status();
  auto batches_after = MetricValue(*metrics_after, "attnserve_batch_requests_count");
  auto requests_after = MetricValue(*metrics_after, "attnserve_batch_requests_sum");
  const double ok_after = OkPrefills(*metrics_after);
  ASSERT_TRUE(batches_after.ok() && requests_after.ok()) << *metrics_after;
  const double batches = *batches_after - batches_before;
  const double requests = *requests_after - requests_before;
  EXPECT_EQ(requests, kClients * kRequestsEach);
  EXPECT_EQ(ok_after - ok_before, kClients * kRequestsEach);
  EXPECT_GE(batches, 1);
  EXPECT_LT(batches, requests) << "every request ran in a batch of its own";
  std::printf("%d concurrent Prefill requests served in %.0f backend batches\n",
              kClients * kRequestsEach, batches);
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

// A restarted server has a new incarnation: KV does not survive a restart.
TEST(RestartTest, EachServerHasItsOwnIncarnation) {
  auto first = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(second.ok()) << second.status();
  auto a = Connect(**first), b = Connect(**second);
  ASSERT_TRUE(a && b);
  EXPECT_NE(a->info().incarnation(), b->info().incarnation());
}

// ------------------------------------------------------------ errors

// The request proto the client library would send for `in` (and a fused
// append), built by hand so that tests can break one field at a time.
v1::PrefillRequest PrefillProto(const KvGeometry& g, const PrefillInputs& in,
                                const std::vector<int64_t>& append_slots,
                                const std::vector<uint16_t>& append_k,
                                const std::vector<uint16_t>& append_v) {
  const v1::DType dtype = g.dtype == KvDType::kFp16 ? v1::DTYPE_FP16 : v1::DTYPE_BF16;
  v1::PrefillRequest r;
  r.set_layer(in.layer);
  r.mutable_q()->set_dtype(dtype);
  for (int64_t d : {in.total_q(), int64_t{g.num_qo_heads}, int64_t{g.head_dim}}) {
    r.mutable_q()->add_shape(d);
  }
  r.mutable_q()->set_data(in.q.data(), in.q.size() * 2);
  r.mutable_qo_indptr()->Add(in.qo_indptr.begin(), in.qo_indptr.end());
  r.mutable_kv_indptr()->Add(in.kv_indptr.begin(), in.kv_indptr.end());
  r.mutable_kv_indices()->Add(in.kv_indices.begin(), in.kv_indices.end());
  r.mutable_kv_last_page_len()->Add(in.kv_last_page_len.begin(), in.kv_last_page_len.end());
  r.set_causal(in.causal);
  r.set_lse_base(in.lse_base_e ? v1::LSE_BASE_E : v1::LSE_BASE_2);
  r.mutable_append_slots()->Add(append_slots.begin(), append_slots.end());
  const int64_t n = static_cast<int64_t>(append_slots.size());
  for (auto [t, data] : {std::pair{r.mutable_append_k(), &append_k},
                         std::pair{r.mutable_append_v(), &append_v}}) {
    t->set_dtype(dtype);
    for (int64_t d : {n, int64_t{g.num_kv_heads}, int64_t{g.head_dim}}) t->add_shape(d);
    t->set_data(data->data(), data->size() * 2);
  }
  return r;
}

void SetTensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape,
               const void* data, size_t bytes) {
  t->set_dtype(dtype);
  t->mutable_shape()->Add(shape.begin(), shape.end());
  t->set_data(data, bytes);
}

// Who sends a request: a tenant's bearer token, none, or a bad one.
enum class Who { kAlice, kBob, kNoToken, kUnknownToken, kWrongScheme };

// A server with two tenants (alice, bob) in --auth_tokens_file and a 1 MiB
// message limit, parametrized by page size.
class AuthServerTest : public ::testing::TestWithParam<int32_t> {
 protected:
  void SetUp() override {
    tokens_path_ = ::testing::TempDir() + "attnserve_tokens_XXXXXX";
    const int fd = mkstemp(tokens_path_.data());
    ASSERT_GE(fd, 0);
    const std::string tokens = "# TOKEN TENANT\ntok-alice alice\n\ntok-bob bob  # second\n";
    ASSERT_EQ(write(fd, tokens.data(), tokens.size()), static_cast<ssize_t>(tokens.size()));
    close(fd);
    TestServerOptions options;
    options.page_size = GetParam();
    options.num_pages = GetParam() == 1 ? 512 : 128;
    options.extra_flags = {"--auth_tokens_file=" + tokens_path_, "--max_message_bytes=1048576"};
    auto server = TestServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    alice_ = Connect(*server_, "tok-alice");
    bob_ = Connect(*server_, "tok-bob");
    ASSERT_TRUE(alice_ && bob_);
    geo_ = GeometryOf(alice_->info());
  }
  void TearDown() override {
    alice_.reset();
    bob_.reset();
    if (server_ != nullptr) {
      EXPECT_EQ(server_->Stop(), 0) << "attnserve did not exit cleanly; its output:\n"
                                    << server_->Output();
    }
    if (!tokens_path_.empty()) unlink(tokens_path_.c_str());
  }

  void Prepare(Who who, grpc::ClientContext* ctx) {
    switch (who) {
      case Who::kAlice: alice_->PrepareContext(ctx); break;
      case Who::kBob: bob_->PrepareContext(ctx); break;
      case Who::kNoToken: break;
      case Who::kUnknownToken: ctx->AddMetadata("authorization", "Bearer tok-mallory"); break;
      case Who::kWrongScheme: ctx->AddMetadata("authorization", "Basic tok-alice"); break;
    }
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  }

// One stub call as `who`; the response is dropped.
#define ATTN_SEND(Rpc, Response)                                             \
  grpc::Status Send(Who who, const v1::Rpc##Request& request) {              \
    grpc::ClientContext ctx;                                                 \
    Prepare(who, &ctx);                                                      \
    v1::Response response;                                                   \
    return alice_->stub()->Rpc(&ctx, request, &response);                    \
  }
  ATTN_SEND(Prefill, PrefillResponse)
  ATTN_SEND(WriteKV, WriteKVResponse)
  ATTN_SEND(ReadKV, ReadKVResponse)
  ATTN_SEND(MergeStates, MergeStatesResponse)
  ATTN_SEND(AllocatePages, AllocatePagesResponse)
  ATTN_SEND(FreePages, FreePagesResponse)
  ATTN_SEND(GetServerInfo, ServerInfo)
#undef ATTN_SEND

  // Raw bytes to Prefill as `who`: what no generated client sends.
  grpc::Status SendRawPrefill(Who who, const std::string& bytes) {
    grpc::GenericStub stub(
        grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    Prepare(who, &ctx);
    grpc::Slice slice(bytes.data(), bytes.size());
    grpc::ByteBuffer request(&slice, 1), response;
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&ctx, "/attnserve.v1.AttentionService/Prefill", grpc::StubOptions(), &request,
                   &response, [&](grpc::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
    done.WaitForNotification();
    return status;
  }

  std::string tokens_path_;
  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> alice_, bob_;
  KvGeometry geo_;
};

INSTANTIATE_TEST_SUITE_P(PageSizes, AuthServerTest, ::testing::Values(1, 16), PageSizeName);

// One malformed request: what it is, how it is sent, and the answer it must get.
struct Rejection {
  std::string name;
  std::function<grpc::Status()> send;
  grpc::StatusCode code;
  std::string field;  // the message must contain it ("" for auth failures)
};

TEST_P(AuthServerTest, EveryMalformedRequestGetsItsCodeAndChangesNothing) {
  std::mt19937_64 gen(GetParam() + 50);
  const int32_t ps = geo_.page_size;
  const int32_t count = GetParam() == 1 ? 64 : 4;
  auto alice_pages = alice_->AllocatePages(count);
  auto bob_pages = bob_->AllocatePages(count);
  ASSERT_TRUE(alice_pages.ok() && bob_pages.ok());
  KvMirror alice_kv(geo_), bob_kv(geo_);
  for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
    ASSERT_NO_FATAL_FAILURE(FillPages(*alice_, alice_kv, gen, layer, *alice_pages));
    ASSERT_NO_FATAL_FAILURE(FillPages(*bob_, bob_kv, gen, layer, *bob_pages));
  }
  const Snapshot alice_before = Read(*alice_, geo_, *alice_pages);
  const Snapshot bob_before = Read(*bob_, geo_, *bob_pages);
  const int32_t free_before = alice_->GetServerInfo()->free_pages();

  // Valid requests (sent at the end, to prove that each rejection below is
  // due to its one broken field).
  const PrefillInputs in = EdgeCaseInputs(gen, geo_, *alice_pages, 1, true, false, 2, 16, 60);
  const std::vector<int64_t> alice_slots = SlotsOfPages(geo_, *alice_pages);
  const std::vector<int64_t> bob_slots = SlotsOfPages(geo_, *bob_pages);
  const std::vector<int64_t> append_slots = {alice_slots[3], alice_slots[0], alice_slots[7]};
  const auto ak = RandomHalves(gen, geo_.dtype, 3 * geo_.RowElems());
  const auto av = RandomHalves(gen, geo_.dtype, 3 * geo_.RowElems());
  const v1::PrefillRequest prefill = PrefillProto(geo_, in, append_slots, ak, av);

  v1::WriteKVRequest write;
  write.set_layer(0);
  const std::vector<int64_t> write_slots = {alice_slots[5], alice_slots[2]};
  write.mutable_slots()->Add(write_slots.begin(), write_slots.end());
  const auto wk = RandomHalves(gen, geo_.dtype, 2 * geo_.RowElems());
  const auto wv = RandomHalves(gen, geo_.dtype, 2 * geo_.RowElems());
  SetTensor(write.mutable_k(), v1::DTYPE_BF16, {2, geo_.num_kv_heads, geo_.head_dim}, wk.data(),
            wk.size() * 2);
  SetTensor(write.mutable_v(), v1::DTYPE_BF16, {2, geo_.num_kv_heads, geo_.head_dim}, wv.data(),
            wv.size() * 2);

  v1::ReadKVRequest read;
  read.set_layer(1);
  read.add_slots(alice_slots[1]);
  read.add_slots(alice_slots[4]);

  v1::MergeStatesRequest merge;
  const std::vector<uint16_t> mv = RandomHalves(gen, geo_.dtype, 2 * 8 * 64);
  const std::vector<float> ml(2 * 8, 0.5f);
  for (int i = 0; i < 2; ++i) {
    v1::AttentionState* st = merge.add_states();
    SetTensor(st->mutable_v(), v1::DTYPE_BF16, {2, 8, 64}, mv.data(), mv.size() * 2);
    SetTensor(st->mutable_lse(), v1::DTYPE_FP32, {2, 8}, ml.data(), ml.size() * 4);
  }

  v1::AllocatePagesRequest alloc;
  alloc.set_count(1);
  v1::FreePagesRequest free_req;
  free_req.add_page_ids((*alice_pages)[0]);

  const auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  const auto kDenied = grpc::StatusCode::PERMISSION_DENIED;
  const auto kUnauth = grpc::StatusCode::UNAUTHENTICATED;
  const auto kExhausted = grpc::StatusCode::RESOURCE_EXHAUSTED;
  const int32_t seq_with_pages = [&] {
    for (size_t b = 0; b + 1 < in.kv_indptr.size(); ++b) {
      if (in.kv_indptr[b + 1] > in.kv_indptr[b]) return static_cast<int32_t>(b);
    }
    return -1;
  }();
  ASSERT_GE(seq_with_pages, 0);

  // Each case edits a copy of a valid request.
  auto P = [&](Who who, std::function<void(v1::PrefillRequest&)> edit) {
    return [this, who, edit, prefill] {
      v1::PrefillRequest r = prefill;
      edit(r);
      return Send(who, r);
    };
  };
  auto W = [&](Who who, std::function<void(v1::WriteKVRequest&)> edit) {
    return [this, who, edit, write] {
      v1::WriteKVRequest r = write;
      edit(r);
      return Send(who, r);
    };
  };
  auto R = [&](Who who, std::function<void(v1::ReadKVRequest&)> edit) {
    return [this, who, edit, read] {
      v1::ReadKVRequest r = read;
      edit(r);
      return Send(who, r);
    };
  };
  auto M = [&](Who who, std::function<void(v1::MergeStatesRequest&)> edit) {
    return [this, who, edit, merge] {
      v1::MergeStatesRequest r = merge;
      edit(r);
      return Send(who, r);
    };
  };
  auto A = [&](Who who, int32_t n) {
    return [this, who, n] {
      v1::AllocatePagesRequest r;
      r.set_count(n);
      return Send(who, r);
    };
  };
  auto F = [&](Who who, std::vector<int32_t> ids) {
    return [this, who, ids] {
      v1::FreePagesRequest r;
      r.mutable_page_ids()->Add(ids.begin(), ids.end());
      return Send(who, r);
    };
  };
  const int32_t num_pages = geo_.num_pages;
  const int64_t num_slots = int64_t{num_pages} * ps;
  auto none = [](auto&) {};

  // Prefill bytes that are not a PrefillRequest: truncated, a field claiming
  // 1 GiB that is not there (rejected before anything is reserved for it).
  const std::string wire = prefill.SerializeAsString();
  const std::string truncated = wire.substr(0, wire.size() / 2);
  const std::string claims_1gib = std::string("\x12\x80\x80\x80\x80\x04", 6) +
                                  std::string("\x1a\xf0\xff\xff\xff\x03", 6) + "xyz";
  auto Raw = [this](Who who, std::string bytes) {
    return [this, who, bytes] { return SendRawPrefill(who, bytes); };
  };
  const std::vector<Rejection> cases = {
      {"Prefill truncated bytes", Raw(Who::kAlice, truncated), kInvalid, "does not parse"},
      {"Prefill field claiming 1 GiB", Raw(Who::kAlice, claims_1gib), kInvalid, "does not parse"},
      {"Prefill raw bytes without a token", Raw(Who::kNoToken, claims_1gib), kUnauth, ""},
      // Prefill: every field.
      {"Prefill layer", P(Who::kAlice, [](auto& r) { r.set_layer(2); }), kInvalid, "layer"},
      {"Prefill q.dtype", P(Who::kAlice, [](auto& r) { r.mutable_q()->set_dtype(v1::DTYPE_FP16); }),
       kInvalid, "q.dtype"},
      {"Prefill q.shape", P(Who::kAlice, [](auto& r) { r.mutable_q()->set_shape(1, 4); }),
       kInvalid, "q.shape"},
      {"Prefill q.data", P(Who::kAlice, [](auto& r) { r.mutable_q()->mutable_data()->pop_back(); }),
       kInvalid, "q.data"},
      {"Prefill qo_indptr end",
       P(Who::kAlice, [](auto& r) { r.set_qo_indptr(r.qo_indptr_size() - 1, 1 << 20); }),
       kInvalid, "qo_indptr"},
      {"Prefill qo_indptr missing", P(Who::kAlice, [](auto& r) { r.clear_qo_indptr(); }),
       kInvalid, "qo_indptr"},
      {"Prefill kv_indptr size", P(Who::kAlice, [](auto& r) { r.add_kv_indptr(1 << 20); }),
       kInvalid, "kv_indptr"},
      {"Prefill kv_indptr decreasing",
       P(Who::kAlice, [&](auto& r) { r.set_kv_indptr(seq_with_pages + 1, -1); }), kInvalid,
       "kv_indptr"},
      {"Prefill kv_indices too large",
       P(Who::kAlice, [&](auto& r) { r.set_kv_indices(0, num_pages); }), kInvalid, "kv_indices"},
      {"Prefill kv_indices negative", P(Who::kAlice, [](auto& r) { r.set_kv_indices(0, -1); }),
       kInvalid, "kv_indices"},
      {"Prefill kv_last_page_len size",
       P(Who::kAlice, [](auto& r) { r.add_kv_last_page_len(1); }), kInvalid, "kv_last_page_len"},
      {"Prefill kv_last_page_len over page",
       P(Who::kAlice, [&](auto& r) { r.set_kv_last_page_len(seq_with_pages, ps + 1); }), kInvalid,
       "kv_last_page_len"},
      {"Prefill kv_last_page_len zero",
       P(Who::kAlice, [&](auto& r) { r.set_kv_last_page_len(seq_with_pages, 0); }), kInvalid,
       "kv_last_page_len"},
      {"Prefill sm_scale",
       P(Who::kAlice, [](auto& r) { r.set_sm_scale(std::numeric_limits<float>::quiet_NaN()); }),
       kInvalid, "sm_scale"},
      {"Prefill lse_base",
       P(Who::kAlice, [](auto& r) { r.set_lse_base(static_cast<v1::LseBase>(7)); }), kInvalid,
       "lse_base"},
      {"Prefill append_slots range",
       P(Who::kAlice, [&](auto& r) { r.set_append_slots(1, num_slots); }), kInvalid,
       "append_slots"},
      {"Prefill append_slots repeated",
       P(Who::kAlice, [](auto& r) { r.set_append_slots(2, r.append_slots(0)); }), kInvalid,
       "append_slots"},
      {"Prefill append_k shape",
       P(Who::kAlice, [](auto& r) { r.mutable_append_k()->set_shape(0, 2); }), kInvalid,
       "append_k"},
      {"Prefill append_v dtype",
       P(Who::kAlice, [](auto& r) { r.mutable_append_v()->set_dtype(v1::DTYPE_FP32); }),
       kInvalid, "append_v"},
      {"Prefill append without rows",
       P(Who::kAlice, [](auto& r) { r.clear_append_v(); }), kInvalid, "append_v"},
      {"Prefill expected_incarnation",
       P(Who::kAlice,
         [&](auto& r) { r.set_expected_incarnation(alice_->info().incarnation() + 1); }),
       grpc::StatusCode::FAILED_PRECONDITION, "expected_incarnation"},
      {"Prefill response over max_message_bytes",
       P(Who::kAlice,
         [&](auto& r) {
           // 1000 rows of q fit a 1 MiB request; output plus LSE do not fit the response.
           const int64_t rows = 1000;
           const std::vector<uint16_t> q = RandomHalves(gen, geo_.dtype, rows * 8 * 64);
           r.Clear();
           SetTensor(r.mutable_q(), v1::DTYPE_BF16, {rows, 8, 64}, q.data(), q.size() * 2);
           r.add_qo_indptr(0);
           r.add_qo_indptr(rows);
           r.add_kv_indptr(0);
           r.add_kv_indptr(0);
           r.add_kv_last_page_len(0);
         }),
       kExhausted, "max_message_bytes"},
      // Prefill: pages of another tenant, by either side.
      {"Prefill kv_indices of bob",
       P(Who::kAlice, [&](auto& r) { r.set_kv_indices(0, (*bob_pages)[1]); }), kDenied,
       "kv_indices"},
      {"Prefill append_slots of bob",
       P(Who::kAlice, [&](auto& r) { r.set_append_slots(1, bob_slots[2]); }), kDenied,
       "append_slots"},
      {"Prefill by bob on alice's pages", P(Who::kBob, none), kDenied, "kv_indices"},
      {"Prefill without token", P(Who::kNoToken, none), kUnauth, ""},
      {"Prefill with unknown token", P(Who::kUnknownToken, none), kUnauth, ""},
      {"Prefill with Basic scheme", P(Who::kWrongScheme, none), kUnauth, ""},
      // WriteKV.
      {"WriteKV layer", W(Who::kAlice, [](auto& r) { r.set_layer(-1); }), kInvalid, "layer"},
      {"WriteKV slots range", W(Who::kAlice, [&](auto& r) { r.set_slots(0, num_slots); }),
       kInvalid, "slots"},
      {"WriteKV slots negative", W(Who::kAlice, [](auto& r) { r.set_slots(1, -4); }), kInvalid,
       "slots"},
      {"WriteKV slots repeated", W(Who::kAlice, [](auto& r) { r.set_slots(1, r.slots(0)); }),
       kInvalid, "slots"},
      {"WriteKV k.shape", W(Who::kAlice, [](auto& r) { r.mutable_k()->set_shape(2, 32); }),
       kInvalid, "k.shape"},
      {"WriteKV v.dtype", W(Who::kAlice, [](auto& r) { r.mutable_v()->set_dtype(v1::DTYPE_FP16); }),
       kInvalid, "v.dtype"},
      {"WriteKV k.data", W(Who::kAlice, [](auto& r) { r.mutable_k()->mutable_data()->resize(10); }),
       kInvalid, "k.data"},
      {"WriteKV into bob's slot", W(Who::kAlice, [&](auto& r) { r.set_slots(1, bob_slots[0]); }),
       kDenied, "slots"},
      {"WriteKV by bob into alice's slots", W(Who::kBob, none), kDenied, "slots"},
      {"WriteKV without token", W(Who::kNoToken, none), kUnauth, ""},
      // ReadKV.
      {"ReadKV layer", R(Who::kAlice, [](auto& r) { r.set_layer(9); }), kInvalid, "layer"},
      {"ReadKV slots range", R(Who::kAlice, [&](auto& r) { r.set_slots(1, num_slots + 5); }),
       kInvalid, "slots"},
      {"ReadKV slots repeated", R(Who::kAlice, [](auto& r) { r.add_slots(r.slots(0)); }),
       kInvalid, "slots"},
      {"ReadKV by bob of alice's slots", R(Who::kBob, none), kDenied, "slots"},
      {"ReadKV without token", R(Who::kNoToken, none), kUnauth, ""},
      // MergeStates.
      {"MergeStates no states", M(Who::kAlice, [](auto& r) { r.clear_states(); }), kInvalid,
       "states"},
      {"MergeStates lse_base",
       M(Who::kAlice, [](auto& r) { r.set_lse_base(static_cast<v1::LseBase>(9)); }), kInvalid,
       "lse_base"},
      {"MergeStates v.shape",
       M(Who::kAlice, [](auto& r) { r.mutable_states(1)->mutable_v()->set_shape(2, 32); }),
       kInvalid, "states[1].v"},
      {"MergeStates v.dtype",
       M(Who::kAlice,
         [](auto& r) { r.mutable_states(0)->mutable_v()->set_dtype(v1::DTYPE_FP16); }),
       kInvalid, "states[0].v.dtype"},
      {"MergeStates lse.dtype",
       M(Who::kAlice,
         [](auto& r) { r.mutable_states(1)->mutable_lse()->set_dtype(v1::DTYPE_BF16); }),
       kInvalid, "states[1].lse"},
      {"MergeStates lse NaN",
       M(Who::kAlice,
         [](auto& r) {
           const float nan = std::numeric_limits<float>::quiet_NaN();
           std::memcpy(r.mutable_states(0)->mutable_lse()->mutable_data()->data() + 12, &nan, 4);
         }),
       kInvalid, "states[0].lse"},
      {"MergeStates n overflowing int64",
       M(Who::kAlice,
         [](auto& r) {
           const int64_t n = (int64_t{1} << 53) + 1;
           const std::string bytes(4096, '\0');
           for (int i = 0; i < 2; ++i) {
             SetTensor(r.mutable_states(i)->mutable_v(), v1::DTYPE_BF16, {n, 1024, 2},
                       bytes.data(), bytes.size());
             SetTensor(r.mutable_states(i)->mutable_lse(), v1::DTYPE_FP32, {n, 1024},
                       bytes.data(), bytes.size());
           }
         }),
       kInvalid, "states[0].v.shape"},
      {"MergeStates without token", M(Who::kNoToken, none), kUnauth, ""},
      // AllocatePages / FreePages / GetServerInfo.
      {"AllocatePages count 0", A(Who::kAlice, 0), kInvalid, "count"},
      {"AllocatePages count negative", A(Who::kAlice, -3), kInvalid, "count"},
      {"AllocatePages more than free", A(Who::kBob, num_pages - 2 * count + 1), kExhausted,
       "count"},
      {"AllocatePages without token", A(Who::kNoToken, 1), kUnauth, ""},
      {"FreePages out of range", F(Who::kAlice, {num_pages}), kInvalid, "page_ids"},
      {"FreePages repeated", F(Who::kAlice, {(*alice_pages)[0], (*alice_pages)[0]}), kInvalid,
       "page_ids"},
      {"FreePages of alice by bob", F(Who::kBob, {(*alice_pages)[0]}), kDenied, "page_ids"},
      {"FreePages own and bob's", F(Who::kAlice, {(*alice_pages)[1], (*bob_pages)[0]}), kDenied,
       "page_ids"},
      {"FreePages without token", F(Who::kNoToken, {(*alice_pages)[0]}), kUnauth, ""},
      {"GetServerInfo without token",
       [this] { return Send(Who::kNoToken, v1::GetServerInfoRequest()); }, kUnauth, ""},
      {"GetServerInfo with unknown token",
       [this] { return Send(Who::kUnknownToken, v1::GetServerInfoRequest()); }, kUnauth, ""},
  };

  for (const Rejection& c : cases) {
    const grpc::Status s = c.send();
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.field)) << c.name;
    ASSERT_TRUE(server_->Alive()) << c.name << " killed the server:\n" << server_->Output();
  }

  // Nothing either tenant wrote changed, and no page changed hands.
  EXPECT_TRUE(Read(*alice_, geo_, *alice_pages) == alice_before);
  EXPECT_TRUE(Read(*bob_, geo_, *bob_pages) == bob_before);
  EXPECT_EQ(alice_->GetServerInfo()->free_pages(), free_before);

  // The server still serves correct results: the valid requests succeed.
  {
    grpc::ClientContext ctx;
    Prepare(Who::kAlice, &ctx);
    v1::PrefillResponse resp;
    grpc::Status s = alice_->stub()->Prefill(&ctx, prefill, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    alice_kv.Write(1, append_slots, ak, av);
    PrefillResult out;
    out.o.resize(resp.output().data().size() / 2);
    std::memcpy(out.o.data(), resp.output().data().data(), resp.output().data().size());
    out.lse.resize(resp.lse().data().size() / 4);
    std::memcpy(out.lse.data(), resp.lse().data().data(), resp.lse().data().size());
    EXPECT_GT(ExpectMatchesReference(alice_kv, in, out), 0);
  }
  ASSERT_TRUE(Send(Who::kAlice, write).ok());
  auto back = alice_->ReadKV(0, write_slots);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->k == wk && back->v == wv);
  EXPECT_TRUE(Send(Who::kAlice, read).ok());
  EXPECT_TRUE(Send(Who::kAlice, merge).ok());
  EXPECT_TRUE(Send(Who::kAlice, alloc).ok());
  EXPECT_TRUE(Send(Who::kAlice, free_req).ok());
  // Bob's data is still his, exactly.
  EXPECT_TRUE(Read(*bob_, geo_, *bob_pages) == bob_before);
}

// A freed page is zeroed before another tenant can get it: alice fills pages
// with KV and frees them, bob then allocates every free page and reads only
// zeros from hers.
TEST_P(AuthServerTest, FreedPagesAreZeroedBeforeAnotherTenantGetsThem) {
  std::mt19937_64 gen(GetParam() + 7);
  auto info = alice_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  const int32_t free_before = info->free_pages();
  auto mine = alice_->AllocatePages(8);
  ASSERT_TRUE(mine.ok()) << mine.status();
  const std::vector<int64_t> slots = SlotsOfPages(geo_, *mine);
  const int64_t n = static_cast<int64_t>(slots.size());
  for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
    const auto k = RandomHalves(gen, geo_.dtype, n * geo_.RowElems());
    const auto v = RandomHalves(gen, geo_.dtype, n * geo_.RowElems());
    ASSERT_TRUE(alice_->WriteKV(layer, slots, k, v).ok());
  }
  ASSERT_TRUE(alice_->FreePages(*mine).ok());
  // Once FreePages has answered, the pages are free again (and zero).
  info = alice_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->free_pages(), free_before);

  auto all = bob_->AllocatePages(info->free_pages());
  ASSERT_TRUE(all.ok()) << all.status();
  const std::set<int32_t> got(all->begin(), all->end());
  for (int32_t p : *mine) ASSERT_EQ(got.count(p), 1u) << "page " << p << " not handed out";
  const Snapshot seen = Read(*bob_, geo_, *mine);
  ASSERT_EQ(static_cast<int32_t>(seen.layers.size()), geo_.num_layers);
  for (const KvData& layer : seen.layers) {
    EXPECT_TRUE(std::all_of(layer.k.begin(), layer.k.end(), [](uint16_t x) { return x == 0; }))
        << "bob read alice's K rows";
    EXPECT_TRUE(std::all_of(layer.v.begin(), layer.v.end(), [](uint16_t x) { return x == 0; }))
        << "bob read alice's V rows";
  }
  ASSERT_TRUE(bob_->FreePages(*all).ok());
}

TEST_P(AuthServerTest, HealthNeedsNoTokenButTheServiceDoes) {
  ClientOptions options;
  options.target = server_->grpc_address();
  options.fetch_info = false;
  auto anonymous = Client::Connect(options);
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  EXPECT_TRUE((*anonymous)->Health("").ok());
  EXPECT_TRUE((*anonymous)->Health("attnserve.v1.AttentionService").ok());
  EXPECT_EQ((*anonymous)->GetServerInfo().status().code(), absl::StatusCode::kUnauthenticated);
  options.fetch_info = true;
  EXPECT_EQ(Client::Connect(options).status().code(), absl::StatusCode::kUnauthenticated);
}

// ------------------------------------------------------------ attnctl

TEST_P(AuthServerTest, AttnctlPrefillMergeAndHealthSucceed) {
  const std::string target = "--target=" + server_->grpc_address();
  std::string out;
  EXPECT_EQ(RunProgram({ATTNCTL_BIN, target, "--token=tok-alice", "--batch=3", "--q_len=24",
                        "--kv_len=64", "prefill"},
                       &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("OK"));
  EXPECT_EQ(RunProgram({ATTNCTL_BIN, target, "--token=tok-bob", "--lse_base_e", "--causal=false",
                        "--layer=1", "--batch=2", "--q_len=16", "--kv_len=40", "prefill"},
                       &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("OK"));
  EXPECT_EQ(RunProgram({ATTNCTL_BIN, target, "--token=tok-alice", "--states=4", "merge"}, &out),
            0)
      << out;
  EXPECT_THAT(out, HasSubstr("OK"));
  EXPECT_EQ(RunProgram({ATTNCTL_BIN, target, "health"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("SERVING"));
  EXPECT_EQ(RunProgram({ATTNCTL_BIN, target, "--token=tok-alice", "info"}, &out), 0) << out;
  // Without a token the service refuses (and attnctl says so).
  EXPECT_NE(RunProgram({ATTNCTL_BIN, target, "prefill"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("UNAUTHENTICATED"));
  // attnctl freed what it allocated.
  EXPECT_EQ(alice_->GetServerInfo()->free_pages(), geo_.num_pages);
}

}  // namespace
}  // namespace attnserve
