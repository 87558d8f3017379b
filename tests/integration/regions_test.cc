// Shared-memory regions against the real server (docs/transport.md): every
// tensor of WriteKV, ReadKV, Prefill and MergeStates read from or written to
// a system region, checked against the float64 reference and against the
// same request sent inline; every bad reference gets its code and a message
// naming the field and bound, changes nothing, and the server keeps serving;
// regions belong to their tenant and are capped; a client killed while
// holding regions leaves them valid until they are reclaimed.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shared_memory.h"
#include "client/workload.h"
#include "common/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/server_fixture.h"
#include "tests/integration/shm_test_util.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using shm_test::Key;
using shm_test::MakeShm;
using shm_test::Ref;

using ::testing::HasSubstr;

constexpr float kNegInfF = -std::numeric_limits<float>::infinity();

template <typename T>
std::vector<T> Read(const SharedMemory& shm, int64_t offset, int64_t count) {
  std::vector<T> out(count);
  std::memcpy(out.data(), shm.data() + offset, count * sizeof(T));
  return out;
}

void Put(SharedMemory& shm, int64_t offset, const void* data, int64_t bytes) {
  std::memcpy(shm.data() + offset, data, bytes);
}

template <typename Field>
void Set(Field* field, std::initializer_list<int64_t> values) {
  field->Clear();
  for (int64_t v : values) field->Add(static_cast<typename Field::value_type>(v));
}

// A server with tenants alice and bob, regions on, at most 6 regions and
// 64 MiB of them per tenant.
class RegionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tokens = WriteTokensFile("tok-alice alice\ntok-bob bob\n");
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    tokens_path_ = *tokens;
    TestServerOptions options;
    options.extra_flags = {"--auth_tokens_file=" + tokens_path_, "--allow_shared_memory",
                           "--max_regions_per_tenant=6", "--max_region_bytes_per_tenant=67108864"};
    auto server = TestServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    alice_ = Connect("tok-alice");
    bob_ = Connect("tok-bob");
    ASSERT_TRUE(alice_ && bob_);
    geo_ = GeometryOf(alice_->info());
  }
  void TearDown() override {
    alice_.reset();
    bob_.reset();
    if (server_ != nullptr) {
      EXPECT_EQ(server_->Stop(), 0) << server_->Output();
    }
    unlink(tokens_path_.c_str());
  }

  std::unique_ptr<Client> Connect(const std::string& token) {
    ClientOptions options;
    options.target = server_->grpc_address();
    options.token = token;
    options.timeout_s = 60;
    auto client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  double Metric(const std::string& name, const std::string& labels) {
    auto body = HttpGet(server_->metrics_address(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    auto v = MetricValue(body.ok() ? *body : "", name, labels);
    return v.ok() ? *v : -1;
  }

  // Random K/V into every slot of `pages` in layer 0, sent through region
  // `name` of `shm` (which must hold 2 * rows * row bytes), and mirrored.
  void FillThroughRegion(KvMirror& mirror, absl::Span<const int32_t> pages, SharedMemory& shm,
                         const std::string& name, std::mt19937_64& gen) {
    const std::vector<int64_t> slots = SlotsOfPages(geo_, pages);
    const int64_t n = static_cast<int64_t>(slots.size()) * geo_.RowElems();
    const auto k = RandomHalves(gen, geo_.dtype, n), v = RandomHalves(gen, geo_.dtype, n);
    Put(shm, 0, k.data(), n * 2);
    Put(shm, n * 2, v.data(), n * 2);
    ASSERT_TRUE(alice_->WriteKVFromRegions(0, slots, RegionRef{name, 0, n * 2},
                                           RegionRef{name, n * 2, n * 2})
                    .ok());
    mirror.Write(0, slots, k, v);
  }

  grpc::Status Send(Client* as, const v1::PrefillRequest& request) {
    grpc::ClientContext ctx;
    as->PrepareContext(&ctx);
    v1::PrefillResponse response;
    return as->stub()->Prefill(&ctx, request, &response);
  }

  std::string tokens_path_;
  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> alice_, bob_;
  KvGeometry geo_;
};

TEST_F(RegionsTest, PrefillWithEveryTensorInARegionMatchesTheReference) {
  std::mt19937_64 gen(31);
  KvMirror mirror(geo_);
  WorkloadSpec spec;
  spec.batch = 5;
  spec.max_q_len = 9;
  spec.max_kv_len = 100;
  auto pages = alice_->AllocatePages(static_cast<int32_t>(PagesNeeded(geo_, spec)) + 1);
  ASSERT_TRUE(pages.ok()) << pages.status();
  const int32_t append_page = pages->back();
  pages->pop_back();
  const int64_t row_bytes = geo_.RowElems() * 2;
  auto kv = MakeShm("kv", 2 * int64_t{static_cast<int64_t>(pages->size())} * geo_.page_size *
                              row_bytes);
  ASSERT_TRUE(kv && alice_->RegisterSystemRegion("kv", kv->key(), 0, kv->size()).ok());
  ASSERT_NO_FATAL_FAILURE(FillThroughRegion(mirror, *pages, *kv, "kv", gen));

  PrefillInputs in = RandomPrefill(gen, geo_, spec, *pages);
  const int64_t total_q = in.total_q();
  const int64_t q_bytes = total_q * geo_.num_qo_heads * geo_.head_dim * 2;
  const int64_t lse_bytes = total_q * geo_.num_qo_heads * 4;
  const std::vector<int64_t> append_slots = {int64_t{append_page} * geo_.page_size,
                                             int64_t{append_page} * geo_.page_size + 1};
  const int64_t append_bytes = 2 * row_bytes;
  const auto ak = RandomHalves(gen, geo_.dtype, 2 * geo_.RowElems());
  const auto av = RandomHalves(gen, geo_.dtype, 2 * geo_.RowElems());
  // One region: q, append_k, append_v, then output and lse behind a gap.
  const int64_t o_at = 4096 + q_bytes + 2 * append_bytes, lse_at = o_at + q_bytes + 64;
  auto io = MakeShm("io", lse_at + lse_bytes + 100);
  ASSERT_TRUE(io && alice_->RegisterSystemRegion("io", io->key(), 0, io->size()).ok());
  Put(*io, 0, in.q.data(), q_bytes);
  Put(*io, q_bytes, ak.data(), append_bytes);
  Put(*io, q_bytes + append_bytes, av.data(), append_bytes);
  std::memset(io->data() + o_at, 0x5a, lse_at + lse_bytes - o_at);

  PrefillArgs args = ArgsOf(in);
  args.q = {};
  args.q_region = RegionRef{"io", 0, q_bytes};
  args.q_rows = total_q;
  args.append_slots = append_slots;
  args.append_k_region = RegionRef{"io", q_bytes, append_bytes};
  args.append_v_region = RegionRef{"io", q_bytes + append_bytes, append_bytes};
  args.output_region = RegionRef{"io", o_at, q_bytes};
  args.lse_region = RegionRef{"io", lse_at, lse_bytes};
  auto got = alice_->Prefill(args);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->o.empty());  // nothing came back inline
  EXPECT_TRUE(got->lse.empty());
  mirror.Write(0, append_slots, ak, av);
  const auto o = Read<uint16_t>(*io, o_at, q_bytes / 2);
  const auto lse = Read<float>(*io, lse_at, lse_bytes / 4);
  std::vector<double> o_ref, lse_ref;
  ReferencePrefill(mirror, in, &o_ref, &lse_ref);
  const Comparison c = Compare(geo_.dtype, o_ref, lse_ref, o, lse);
  EXPECT_TRUE(c.Ok(geo_.dtype)) << c.ToString();
  // The bytes between output and lse were not touched.
  for (int64_t i = o_at + q_bytes; i < lse_at; ++i) ASSERT_EQ(io->data()[i], 0x5a);

  // The same request sent inline gives the same bytes.
  auto inline_result = alice_->Prefill(ArgsOf(in));
  ASSERT_TRUE(inline_result.ok()) << inline_result.status();
  EXPECT_EQ(inline_result->o, o);
  EXPECT_EQ(inline_result->lse, lse);

  // ReadKV into the region: the appended rows.
  const int64_t back_at = 0;
  ASSERT_TRUE(alice_->ReadKVToRegions(0, append_slots, RegionRef{"kv", back_at, append_bytes},
                                      RegionRef{"kv", back_at + append_bytes, append_bytes})
                  .ok());
  EXPECT_EQ(Read<uint16_t>(*kv, back_at, append_bytes / 2), ak);
  EXPECT_EQ(Read<uint16_t>(*kv, back_at + append_bytes, append_bytes / 2), av);

  EXPECT_GE(Metric("attnserve_transfer_bytes_total", "direction=\"in\",path=\"system\""),
            q_bytes + 2 * append_bytes);
  EXPECT_GE(Metric("attnserve_transfer_bytes_total", "direction=\"out\",path=\"system\""),
            q_bytes + lse_bytes + 2 * append_bytes);
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 2);
  EXPECT_EQ(Metric("attnserve_tenant_region_bytes", "tenant=\"alice\""), kv->size() + io->size());
  EXPECT_TRUE(alice_->UnregisterRegion("io").ok());
  EXPECT_TRUE(alice_->UnregisterRegion("kv").ok());
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 0);
}

TEST_F(RegionsTest, MergeStatesInRegionsMatchesTheReference) {
  std::mt19937_64 gen(12);
  const int64_t n = 6;
  const int32_t h = geo_.num_qo_heads, d = geo_.head_dim;
  const int64_t v_bytes = n * h * d * 2, lse_bytes = n * h * 4;
  std::vector<State> states(3);
  std::uniform_real_distribution<float> lse_dist(-20.f, 20.f);
  std::bernoulli_distribution neg_inf(0.2);
  for (State& s : states) {
    s.v = RandomHalves(gen, geo_.dtype, n * h * d);
    s.lse.resize(n * h);
    for (float& l : s.lse) l = neg_inf(gen) ? kNegInfF : lse_dist(gen);
  }
  auto shm = MakeShm("merge", 4 * (v_bytes + lse_bytes));
  ASSERT_TRUE(shm && alice_->RegisterSystemRegion("m", shm->key(), 0, shm->size()).ok());
  v1::MergeStatesRequest req;
  for (size_t i = 0; i < states.size(); ++i) {
    const int64_t at = static_cast<int64_t>(i) * (v_bytes + lse_bytes);
    Put(*shm, at, states[i].v.data(), v_bytes);
    Put(*shm, at + v_bytes, states[i].lse.data(), lse_bytes);
    v1::AttentionState* s = req.add_states();
    s->mutable_v()->set_dtype(v1::DTYPE_BF16);
    Set(s->mutable_v()->mutable_shape(), {n, h, d});
    *s->mutable_v()->mutable_region() = Ref("m", at, v_bytes);
    s->mutable_lse()->set_dtype(v1::DTYPE_FP32);
    Set(s->mutable_lse()->mutable_shape(), {n, h});
    *s->mutable_lse()->mutable_region() = Ref("m", at + v_bytes, lse_bytes);
  }
  const int64_t out_at = 3 * (v_bytes + lse_bytes);
  *req.mutable_v_region() = Ref("m", out_at, v_bytes);
  *req.mutable_lse_region() = Ref("m", out_at + v_bytes, lse_bytes);
  grpc::ClientContext ctx;
  alice_->PrepareContext(&ctx);
  v1::MergeStatesResponse resp;
  grpc::Status s = alice_->stub()->MergeStates(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_TRUE(resp.v().data().empty());
  EXPECT_EQ(resp.v().shape_size(), 3);
  const auto v = Read<uint16_t>(*shm, out_at, v_bytes / 2);
  const auto lse = Read<float>(*shm, out_at + v_bytes, lse_bytes / 4);
  std::vector<double> v_ref, lse_ref;
  server_test::ReferenceMerge(states, n * h, d, geo_.dtype, /*base_e=*/false, &v_ref, &lse_ref);
  const Comparison c = Compare(geo_.dtype, v_ref, lse_ref, v, lse);
  EXPECT_TRUE(c.Ok(geo_.dtype)) << c.ToString();
  auto inline_result = alice_->MergeStates(states, n, h, d, false);
  ASSERT_TRUE(inline_result.ok());
  EXPECT_EQ(inline_result->v, v);
  EXPECT_EQ(inline_result->lse, lse);
}

TEST_F(RegionsTest, BadReferencesNameTheFieldChangeNothingAndTheServerKeepsServing) {
  std::mt19937_64 gen(3);
  KvMirror mirror(geo_);
  auto pages = alice_->AllocatePages(2);
  ASSERT_TRUE(pages.ok());
  const int64_t row_bytes = geo_.RowElems() * 2;
  auto kv = MakeShm("kv", 2 * 2 * geo_.page_size * row_bytes);
  ASSERT_TRUE(kv && alice_->RegisterSystemRegion("kv", kv->key(), 0, kv->size()).ok());
  ASSERT_NO_FATAL_FAILURE(FillThroughRegion(mirror, *pages, *kv, "kv", gen));
  auto theirs = MakeShm("bob", 1 << 16);
  ASSERT_TRUE(theirs && bob_->RegisterSystemRegion("bobs", theirs->key(), 0, 1 << 16).ok());

  // A one-sequence Prefill: 3 query rows over the 2 pages.
  const int64_t total_q = 3;
  const int64_t q_bytes = total_q * geo_.num_qo_heads * geo_.head_dim * 2;
  const int64_t lse_bytes = total_q * geo_.num_qo_heads * 4;
  auto io = MakeShm("io", 1 << 16);
  ASSERT_TRUE(io && alice_->RegisterSystemRegion("io", io->key(), 0, 1 << 16).ok());
  const auto q = RandomHalves(gen, geo_.dtype, q_bytes / 2);
  Put(*io, 0, q.data(), q_bytes);
  const int64_t o_at = 8192, lse_at = o_at + q_bytes;
  std::memset(io->data() + o_at, 0x77, q_bytes + lse_bytes);
  auto base = [&] {
    v1::PrefillRequest r;
    r.mutable_q()->set_dtype(v1::DTYPE_BF16);
    Set(r.mutable_q()->mutable_shape(), {total_q, geo_.num_qo_heads, geo_.head_dim});
    *r.mutable_q()->mutable_region() = Ref("io", 0, q_bytes);
    Set(r.mutable_qo_indptr(), {0, 3});
    Set(r.mutable_kv_indptr(), {0, 2});
    Set(r.mutable_kv_indices(), {(*pages)[0], (*pages)[1]});
    r.mutable_kv_last_page_len()->Add(geo_.page_size);
    *r.mutable_output_region() = Ref("io", o_at, q_bytes);
    *r.mutable_lse_region() = Ref("io", lse_at, lse_bytes);
    return r;
  };
  ASSERT_TRUE(Send(alice_.get(), base()).ok());  // the good request works
  std::vector<char> good_output(io->data() + o_at, io->data() + o_at + q_bytes + lse_bytes);
  std::memset(io->data() + o_at, 0x77, q_bytes + lse_bytes);

  struct Case {
    std::string what;
    std::function<void(v1::PrefillRequest*)> edit;
    grpc::StatusCode code;
    std::string text;
  } cases[] = {
      {"unknown region", [](v1::PrefillRequest* r) { r->mutable_q()->mutable_region()->set_name("nope"); },
       grpc::StatusCode::NOT_FOUND, "q.region.name: region 'nope' is not registered"},
      {"offset past the end", [](v1::PrefillRequest* r) { r->mutable_q()->mutable_region()->set_offset(1 << 17); },
       grpc::StatusCode::INVALID_ARGUMENT, "q.region.offset=131072 out of range [0, 65536]"},
      {"range past the end",
       [](v1::PrefillRequest* r) { r->mutable_q()->mutable_region()->set_offset((1 << 16) - 100); },
       grpc::StatusCode::INVALID_ARGUMENT, "exceeds the size of region 'io' (65536 bytes)"},
      {"negative size", [](v1::PrefillRequest* r) { r->mutable_q()->mutable_region()->set_byte_size(-2); },
       grpc::StatusCode::INVALID_ARGUMENT, "q.region.byte_size = 0 + -2"},
      {"size not the shape's",
       [=](v1::PrefillRequest* r) { r->mutable_q()->mutable_region()->set_byte_size(q_bytes - 2); },
       grpc::StatusCode::INVALID_ARGUMENT, "q.region.byte_size="},
      {"misaligned", [](v1::PrefillRequest* r) { r->mutable_q()->mutable_region()->set_offset(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "multiple of 2 bytes"},
      {"data and region", [](v1::PrefillRequest* r) { r->mutable_q()->set_data("xx"); },
       grpc::StatusCode::INVALID_ARGUMENT, "q.data has 2 bytes and q.region is set"},
      {"another tenant's region",
       [](v1::PrefillRequest* r) { r->mutable_q()->mutable_region()->set_name("bobs"); },
       grpc::StatusCode::PERMISSION_DENIED, "region 'bobs' belongs to another tenant"},
      {"output too small",
       [=](v1::PrefillRequest* r) { r->mutable_output_region()->set_byte_size(q_bytes - 2); },
       grpc::StatusCode::INVALID_ARGUMENT, "output_region.byte_size="},
      {"lse misaligned",
       [=](v1::PrefillRequest* r) { r->mutable_lse_region()->set_offset(lse_at + 2); },
       grpc::StatusCode::INVALID_ARGUMENT, "lse_region.offset"},
      {"output without lse", [](v1::PrefillRequest* r) { r->clear_lse_region(); },
       grpc::StatusCode::INVALID_ARGUMENT, "output_region and lse_region go together"},
      {"output over the query",
       [=](v1::PrefillRequest* r) { r->mutable_output_region()->set_offset(0); },
       grpc::StatusCode::INVALID_ARGUMENT, "overlaps q.region"},
      {"lse over the output",
       [=](v1::PrefillRequest* r) { r->mutable_lse_region()->set_offset(o_at); },
       grpc::StatusCode::INVALID_ARGUMENT, "overlaps output_region"},
      {"output in another tenant's region",
       [](v1::PrefillRequest* r) { r->mutable_output_region()->set_name("bobs"); },
       grpc::StatusCode::PERMISSION_DENIED, "output_region.name"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    v1::PrefillRequest r = base();
    c.edit(&r);
    grpc::Status s = Send(alice_.get(), r);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.text));
    // Nothing was written.
    for (int64_t i = 0; i < q_bytes + lse_bytes; ++i) ASSERT_EQ(io->data()[o_at + i], 0x77);
  }

  // WriteKV and ReadKV.
  const std::vector<int64_t> slots = {int64_t{(*pages)[0]} * geo_.page_size};
  auto write = [&](const std::string& name, int64_t offset, int64_t bytes) {
    return alice_->WriteKVFromRegions(0, slots, RegionRef{name, offset, bytes},
                                      RegionRef{"io", 0, row_bytes});
  };
  absl::Status w = write("nope", 0, row_bytes);
  EXPECT_EQ(w.code(), absl::StatusCode::kNotFound) << w;
  EXPECT_THAT(std::string(w.message()), HasSubstr("k.region.name"));
  w = write("io", 0, row_bytes + 2);
  EXPECT_EQ(w.code(), absl::StatusCode::kInvalidArgument) << w;
  EXPECT_THAT(std::string(w.message()), HasSubstr("k.region.byte_size="));
  w = write("bobs", 0, row_bytes);
  EXPECT_EQ(w.code(), absl::StatusCode::kPermissionDenied) << w;
  absl::Status rd = alice_->ReadKVToRegions(0, slots, RegionRef{"io", o_at, row_bytes - 2},
                                            RegionRef{"io", o_at + row_bytes, row_bytes});
  EXPECT_EQ(rd.code(), absl::StatusCode::kInvalidArgument) << rd;
  EXPECT_THAT(std::string(rd.message()), HasSubstr("k_region.byte_size="));
  {
    v1::ReadKVRequest only_k;
    only_k.add_slots(slots[0]);
    *only_k.mutable_k_region() = Ref("io", o_at, row_bytes);
    grpc::ClientContext ctx;
    alice_->PrepareContext(&ctx);
    v1::ReadKVResponse resp;
    grpc::Status s = alice_->stub()->ReadKV(&ctx, only_k, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("k_region and v_region go together"));
  }
  for (int64_t i = 0; i < q_bytes + lse_bytes; ++i) ASSERT_EQ(io->data()[o_at + i], 0x77);

  // The KV is what it was; the server serves; the regions are all there;
  // the good request still gives the same output.
  const std::vector<int64_t> all = SlotsOfPages(geo_, *pages);
  auto kv_now = alice_->ReadKV(0, all);
  ASSERT_TRUE(kv_now.ok());
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_TRUE(std::equal(kv_now->k.begin() + i * geo_.RowElems(),
                           kv_now->k.begin() + (i + 1) * geo_.RowElems(), mirror.K(0, all[i])));
  }
  EXPECT_TRUE(alice_->Health().ok());
  auto listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].name(), "io");
  EXPECT_EQ((*listed)[0].in_use(), 0);
  ASSERT_TRUE(Send(alice_.get(), base()).ok());
  EXPECT_EQ(std::memcmp(io->data() + o_at, good_output.data(), good_output.size()), 0);
}

TEST_F(RegionsTest, RegionsBelongToTheirTenantAndAreCapped) {
  auto shm = MakeShm("own", 1 << 20);
  ASSERT_TRUE(shm);
  ASSERT_TRUE(alice_->RegisterSystemRegion("a0", shm->key(), 0, 4096).ok());
  absl::Status taken = bob_->RegisterSystemRegion("a0", shm->key(), 0, 4096);
  EXPECT_EQ(taken.code(), absl::StatusCode::kAlreadyExists) << taken;
  absl::Status unreg = bob_->UnregisterRegion("a0");
  EXPECT_EQ(unreg.code(), absl::StatusCode::kPermissionDenied) << unreg;
  auto bobs = bob_->ListRegions();
  ASSERT_TRUE(bobs.ok());
  EXPECT_TRUE(bobs->empty());
  for (int i = 1; i < 6; ++i) {
    ASSERT_TRUE(alice_->RegisterSystemRegion(absl::StrCat("a", i), shm->key(), 0, 4096).ok());
  }
  absl::Status count = alice_->RegisterSystemRegion("a6", shm->key(), 0, 4096);
  EXPECT_EQ(count.code(), absl::StatusCode::kResourceExhausted) << count;
  EXPECT_THAT(std::string(count.message()), HasSubstr("--max_regions_per_tenant"));
  absl::Status bytes = bob_->RegisterSystemRegion("b0", shm->key(), 0, (64 << 20) + 1);
  EXPECT_EQ(bytes.code(), absl::StatusCode::kInvalidArgument) << bytes;
  EXPECT_THAT(std::string(bytes.message()), HasSubstr("--max_region_bytes_per_tenant"));
  absl::Status missing = bob_->RegisterSystemRegion("b0", "/attn_it_never_made", 0, 8);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 6);
  EXPECT_EQ(Metric("attnserve_tenant_region_bytes", "tenant=\"alice\""), 6 * 4096);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(alice_->UnregisterRegion(absl::StrCat("a", i)).ok());
  EXPECT_EQ(alice_->UnregisterRegion("a0").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(bob_->RegisterSystemRegion("a0", shm->key(), 0, 4096).ok());
}

// CUDA regions on the CPU backend: the shape of the request is checked
// first (each bad field named with its bound), then the backend refuses the
// handle by name; nothing is registered, nothing is counted, and the server
// keeps serving requests that name regions.
TEST_F(RegionsTest, CudaRegionsAreRefusedByTheCpuBackend) {
  struct Case {
    std::string name, handle;
    int32_t device_id;
    int64_t byte_size;
    absl::StatusCode code;
    std::string text;
  };
  const std::string handle(64, '\x5a');
  const std::vector<Case> cases = {
      {"g", handle, 0, 1 << 20, absl::StatusCode::kFailedPrecondition, "cpu backend"},
      {"g", handle.substr(0, 10), 0, 1024, absl::StatusCode::kInvalidArgument,
       "cuda.ipc_handle has 10 bytes: a cudaIpcMemHandle_t has 64"},
      {"g", handle + "x", 0, 1024, absl::StatusCode::kInvalidArgument, "cuda.ipc_handle has 65"},
      {"g", "", 0, 1024, absl::StatusCode::kInvalidArgument, "cuda.ipc_handle has 0"},
      {"g", handle, -1, 1024, absl::StatusCode::kInvalidArgument, "cuda.device_id=-1"},
      {"g", handle, 0, 0, absl::StatusCode::kInvalidArgument, "cuda.byte_size=0 out of range [1, "},
      {"g", handle, 0, (64 << 20) + 1, absl::StatusCode::kInvalidArgument,
       "--max_region_bytes_per_tenant"},
      {"bad name", handle, 0, 1024, absl::StatusCode::kInvalidArgument, "[A-Za-z0-9_.-]"},
  };
  for (const Case& c : cases) {
    absl::Status s = bob_->RegisterCudaRegion(c.name, c.handle, c.device_id, c.byte_size);
    EXPECT_EQ(s.code(), c.code) << c.text << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.text));
  }
  auto listed = bob_->ListRegions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_TRUE(listed->empty());
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"bob\""), 0);
  EXPECT_EQ(Metric("attnserve_tenant_region_bytes", "tenant=\"bob\""), 0);
  // A tensor naming the refused name: NOT_FOUND, as for any unknown region.
  auto pages = bob_->AllocatePages(1);
  ASSERT_TRUE(pages.ok()) << pages.status();
  const std::vector<int64_t> slots = {int64_t{(*pages)[0]} * geo_.page_size};
  const int64_t row = geo_.RowElems() * 2;
  absl::Status unknown = bob_->WriteKVFromRegions(0, slots, RegionRef{"g", 0, row}, RegionRef{"g", row, row});
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("k.region.name: region 'g' is not registered"));
  // Still serving, regions included.
  auto shm = MakeShm("after_cuda", 2 * row);
  ASSERT_TRUE(shm);
  ASSERT_TRUE(bob_->RegisterSystemRegion("s", shm->key(), 0, shm->size()).ok());
  EXPECT_TRUE(bob_->WriteKVFromRegions(0, slots, RegionRef{"s", 0, row}, RegionRef{"s", row, row}).ok());
  EXPECT_TRUE(bob_->UnregisterRegion("s").ok());
}

// A client process registers a region and is killed without unregistering.
TEST_F(RegionsTest, AKilledClientsRegionsStayValidUntilReclaimed) {
  const int64_t rows = 2 * geo_.page_size;
  const int64_t bytes = 2 * rows * geo_.RowElems() * 2;  // k then v
  auto spawn = [&](const std::string& key, const std::string& name, uint64_t seed) {
    int pipe_fds[2];
    EXPECT_EQ(pipe(pipe_fds), 0);
    const std::string size = std::to_string(bytes), seed_s = std::to_string(seed);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(pipe_fds[1], 1);
      close(pipe_fds[0]);
      execl(REGION_HOLDER_BIN, REGION_HOLDER_BIN, server_->grpc_address().c_str(), "tok-alice",
            key.c_str(), name.c_str(), size.c_str(), seed_s.c_str(), nullptr);
      _exit(127);
    }
    close(pipe_fds[1]);
    char buf[16] = {};
    const ssize_t got = read(pipe_fds[0], buf, sizeof(buf) - 1);
    close(pipe_fds[0]);
    EXPECT_GT(got, 0);
    EXPECT_EQ(std::string(buf), "ready\n");
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status));
  };
  const std::string key1 = Key("held"), key2 = Key("held");
  spawn(key1, "held1", 77);
  spawn(key2, "held2", 78);
  EXPECT_TRUE(alice_->Health().ok());
  auto listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_TRUE((*listed)[0].key_exists());
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 2);

  // The dead client's bytes are still there: write them as KV and read back.
  auto pages = alice_->AllocatePages(2);
  ASSERT_TRUE(pages.ok());
  const std::vector<int64_t> slots = SlotsOfPages(geo_, *pages);
  std::mt19937_64 gen(77);
  const auto values = RandomHalves(gen, KvDType::kBf16, bytes / 2);
  const int64_t half = bytes / 2;
  ASSERT_TRUE(alice_->WriteKVFromRegions(0, slots, RegionRef{"held1", 0, half},
                                         RegionRef{"held1", half, half})
                  .ok());
  auto read = alice_->ReadKV(0, slots);
  ASSERT_TRUE(read.ok());
  EXPECT_TRUE(std::equal(read->k.begin(), read->k.end(), values.begin()));
  EXPECT_TRUE(std::equal(read->v.begin(), read->v.end(), values.begin() + half / 2));

  // Reclaimed when its key vanishes (as Python's resource tracker or an
  // operator would unlink it)...
  ASSERT_EQ(shm_unlink(key1.c_str()), 0);
  listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name(), "held2");
  // ...or by the tenant from another connection.
  EXPECT_TRUE(alice_->UnregisterRegion("held2").ok());
  ASSERT_EQ(shm_unlink(key2.c_str()), 0);
  listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 0);
  EXPECT_TRUE(alice_->FreePages(*pages).ok());
}

TEST(RegionsOffTest, WithoutTheFlagRegionsAreRefused) {
  auto server = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions options;
  options.target = (*server)->grpc_address();
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  auto shm = MakeShm("off", 4096);
  ASSERT_TRUE(shm);
  absl::Status s = (*client)->RegisterSystemRegion("r", shm->key(), 0, 4096);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("--allow_shared_memory"));
  auto pages = (*client)->AllocatePages(1);
  ASSERT_TRUE(pages.ok());
  const std::vector<int64_t> slots = {int64_t{(*pages)[0]} * 16};
  absl::Status w = (*client)->WriteKVFromRegions(0, slots, RegionRef{"r", 0, 256},
                                                 RegionRef{"r", 256, 256});
  EXPECT_EQ(w.code(), absl::StatusCode::kFailedPrecondition) << w;
  auto listed = (*client)->ListRegions();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
  EXPECT_TRUE((*client)->Health().ok());
  EXPECT_EQ((*server)->Stop(), 0);
}

}  // namespace
}  // namespace attnserve
