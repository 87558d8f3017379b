// Shared pieces of the server integration tests (server_*_test.cc): the real
// attnserve binary (CPU backend) on a free port, driven through the C++ client
// (client/client.h) and hand-made protos.
//
// Results are checked against the float64 reference of common/reference.h
// (through client/workload.h) with docs/design.md's tolerances; errors by
// their gRPC code and a message that names the field; batching by the
// server's own Prometheus metrics. The fixtures are instantiated once, in
// server_fixture.cc.
#pragma once

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


namespace attnserve {
namespace server_test {

using ::testing::HasSubstr;

inline constexpr float kNegInfF = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------ helpers

// Prefills answered OK, decode and prefill shapes together.
inline double OkPrefills(const std::string& metrics) {
  double n = 0;
  for (const char* shape : {"decode", "prefill"}) {
    n += MetricValue(metrics, "attnserve_requests_total",
                     absl::StrCat("code=\"OK\",method=\"Prefill\",shape=\"", shape, "\""))
             .value_or(0);
  }
  return n;
}


inline std::unique_ptr<Client> Connect(const TestServer& server, const std::string& token = "") {
  ClientOptions options;
  options.target = server.grpc_address();
  options.token = token;
  options.timeout_s = 120;  // a hung server fails the test instead of hanging it
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// Writes random K/V into every slot of `pages` in `layer`, and into the mirror.
inline void FillPages(Client& client, KvMirror& mirror, std::mt19937_64& gen, int32_t layer,
               absl::Span<const int32_t> pages) {
  const KvGeometry& g = mirror.geometry();
  const std::vector<int64_t> slots = SlotsOfPages(g, pages);
  const int64_t n = static_cast<int64_t>(slots.size()) * g.RowElems();
  // MLA: the latent rows in k, no v.
  const std::vector<uint16_t> k = RandomHalves(gen, g.dtype, n),
                              v = RandomHalves(gen, g.dtype, g.HasVPool() ? n : 0);
  absl::Status s = client.WriteKV(layer, slots, k, v);
  ASSERT_TRUE(s.ok()) << s;
  mirror.Write(layer, slots, k, v);
}

// A ragged batch with every edge case: an empty sequence, one without pages,
// one with nothing at all, more rows than KV tokens (a partial last page),
// an exactly full last page, a decode row, plus random sequences; page ids
// drawn with replacement from `pages` (repeated, in any order).
inline PrefillInputs EdgeCaseInputs(std::mt19937_64& gen, const KvGeometry& g,
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
inline int64_t ExpectMatchesReference(const KvMirror& mirror, const PrefillInputs& in,
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
    for (int32_t c2 = 0; c2 < g.VDim(); ++c2) {
      if (HalfToFloat(g.dtype, out.o[r * g.VDim() + c2]) != 0.f) {
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
      if (layers[i].k != o.layers[i].k || layers[i].v != o.layers[i].v ||
          layers[i].k_fp8 != o.layers[i].k_fp8 || layers[i].v_fp8 != o.layers[i].v_fp8) {
        return false;
      }
    }
    return true;
  }
};

inline Snapshot Read(Client& client, const KvGeometry& g, absl::Span<const int32_t> pages) {
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

inline std::string PageSizeName(const ::testing::TestParamInfo<int32_t>& info) {
  return absl::StrCat("PageSize", info.param);
}


// The float64 merge of common/reference.h over the client's states.
inline void ReferenceMerge(const std::vector<State>& states, int64_t rows, int32_t d, KvDType dtype,
                    bool base_e, std::vector<double>* v, std::vector<double>* lse) {
  std::vector<reference::State> ref;
  for (const State& s : states) ref.push_back({s.v.data(), s.lse.data()});
  reference::Merge(dtype, ref, rows, d, base_e, v, lse);
}

// ------------------------------------------------------------ errors

// The request proto the client library would send for `in` (and a fused
// append), built by hand so that tests can break one field at a time.
inline v1::PrefillRequest PrefillProto(const KvGeometry& g, const PrefillInputs& in,
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
  r.mutable_q()->set_data(in.q.data(), in.q.size() * sizeof(uint16_t));
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

inline void SetTensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape,
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
    auto tokens = WriteTokensFile("# TOKEN TENANT\ntok-alice alice\n\ntok-bob bob  # second\n");
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    tokens_path_ = *tokens;
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


}  // namespace server_test
}  // namespace attnserve
