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
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shared_memory.h"
#include "client/workload.h"
#include "common/dtype.h"
#include "common/region_socket.h"
#include "common/unique_fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/server_fixture.h"
#include "tests/integration/shm_test_util.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

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

  // RegisterRegion of a system region as sent by hand: a claim token or a
  // (no longer served) shm key.
  absl::Status RegisterRaw(Client* as, const std::string& name, const std::string& claim_token,
                           int64_t offset, int64_t bytes, const std::string& key = "") {
    grpc::ClientContext ctx;
    as->PrepareContext(&ctx);
    v1::RegisterRegionRequest req;
    req.set_name(name);
    req.mutable_system()->set_claim_token(claim_token);
    req.mutable_system()->set_key(key);
    req.mutable_system()->set_offset(offset);
    req.mutable_system()->set_byte_size(bytes);
    v1::RegisterRegionResponse resp;
    return Client::FromGrpc(as->stub()->RegisterRegion(&ctx, req, &resp));
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
  ASSERT_TRUE(kv && alice_->RegisterSystemRegion("kv", *kv, 0, kv->size()).ok());
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
  ASSERT_TRUE(io && alice_->RegisterSystemRegion("io", *io, 0, io->size()).ok());
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
  ASSERT_TRUE(shm && alice_->RegisterSystemRegion("m", *shm, 0, shm->size()).ok());
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
  ASSERT_TRUE(kv && alice_->RegisterSystemRegion("kv", *kv, 0, kv->size()).ok());
  ASSERT_NO_FATAL_FAILURE(FillThroughRegion(mirror, *pages, *kv, "kv", gen));
  auto theirs = MakeShm("bob", 1 << 16);
  ASSERT_TRUE(theirs && bob_->RegisterSystemRegion("bobs", *theirs, 0, 1 << 16).ok());

  // A one-sequence Prefill: 3 query rows over the 2 pages.
  const int64_t total_q = 3;
  const int64_t q_bytes = total_q * geo_.num_qo_heads * geo_.head_dim * 2;
  const int64_t lse_bytes = total_q * geo_.num_qo_heads * 4;
  auto io = MakeShm("io", 1 << 16);
  ASSERT_TRUE(io && alice_->RegisterSystemRegion("io", *io, 0, 1 << 16).ok());
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
       grpc::StatusCode::INVALID_ARGUMENT, "q.region.byte_size=-2 is negative"},
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
  ASSERT_TRUE(alice_->RegisterSystemRegion("a0", *shm, 0, 4096).ok());
  absl::Status taken = bob_->RegisterSystemRegion("a0", *shm, 0, 4096);
  EXPECT_EQ(taken.code(), absl::StatusCode::kAlreadyExists) << taken;
  absl::Status unreg = bob_->UnregisterRegion("a0");
  EXPECT_EQ(unreg.code(), absl::StatusCode::kPermissionDenied) << unreg;
  auto bobs = bob_->ListRegions();
  ASSERT_TRUE(bobs.ok());
  EXPECT_TRUE(bobs->empty());
  for (int i = 1; i < 6; ++i) {
    ASSERT_TRUE(alice_->RegisterSystemRegion(absl::StrCat("a", i), *shm, 0, 4096).ok());
  }
  absl::Status count = alice_->RegisterSystemRegion("a6", *shm, 0, 4096);
  EXPECT_EQ(count.code(), absl::StatusCode::kResourceExhausted) << count;
  EXPECT_THAT(std::string(count.message()), HasSubstr("--max_regions_per_tenant"));
  absl::Status bytes = bob_->RegisterSystemRegion("b0", *shm, 0, (64 << 20) + 1);
  EXPECT_EQ(bytes.code(), absl::StatusCode::kInvalidArgument) << bytes;
  EXPECT_THAT(std::string(bytes.message()), HasSubstr("--max_region_bytes_per_tenant"));
  // A token nothing was deposited under.
  absl::Status missing = RegisterRaw(bob_.get(), "b0", std::string(16, 'x'), 0, 8);
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_THAT(std::string(missing.message()), HasSubstr("no memfd is deposited under this token"));
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 6);
  EXPECT_EQ(Metric("attnserve_tenant_region_bytes", "tenant=\"alice\""), 6 * 4096);
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(alice_->UnregisterRegion(absl::StrCat("a", i)).ok());
  EXPECT_EQ(alice_->UnregisterRegion("a0").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(bob_->RegisterSystemRegion("a0", *shm, 0, 4096).ok());
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
  ASSERT_TRUE(bob_->RegisterSystemRegion("s", *shm, 0, shm->size()).ok());
  EXPECT_TRUE(bob_->WriteKVFromRegions(0, slots, RegionRef{"s", 0, row}, RegionRef{"s", row, row}).ok());
  EXPECT_TRUE(bob_->UnregisterRegion("s").ok());
}

// Client processes register regions without unregistering: one is killed,
// one lives on. The killed one's region stays valid (its bytes readable)
// until the tenant's next ListRegions reclaims it; the live one's stays
// until the tenant unregisters it from another connection.
TEST_F(RegionsTest, AKilledClientsRegionsStayValidUntilReclaimed) {
  const int64_t rows = 2 * geo_.page_size;
  const int64_t bytes = 2 * rows * geo_.RowElems() * 2;  // k then v
  auto spawn = [&](const std::string& name, uint64_t seed) -> pid_t {
    int pipe_fds[2];
    EXPECT_EQ(pipe(pipe_fds), 0);
    const std::string size = std::to_string(bytes), seed_s = std::to_string(seed);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(pipe_fds[1], 1);
      close(pipe_fds[0]);
      execl(REGION_HOLDER_BIN, REGION_HOLDER_BIN, server_->grpc_address().c_str(), "tok-alice",
            name.c_str(), size.c_str(), seed_s.c_str(), nullptr);
      _exit(127);
    }
    close(pipe_fds[1]);
    char buf[16] = {};
    const ssize_t got = read(pipe_fds[0], buf, sizeof(buf) - 1);
    close(pipe_fds[0]);
    EXPECT_GT(got, 0);
    EXPECT_EQ(std::string(buf), "ready\n");
    return pid;
  };
  auto kill_and_wait = [](pid_t pid) {
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status));
  };
  const pid_t dead = spawn("held1", 77);
  const pid_t alive = spawn("held2", 78);
  kill_and_wait(dead);
  EXPECT_TRUE(alice_->Health().ok());
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

  // Reclaimed at the tenant's next ListRegions: its holder connection
  // closed when the process died...
  auto listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name(), "held2");
  EXPECT_EQ((*listed)[0].key(), "held2");  // the memfd's name
  EXPECT_TRUE((*listed)[0].key_exists());  // its client is alive
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 1);
  // ...while the live client's region goes when the tenant unregisters it
  // from another connection.
  EXPECT_TRUE(alice_->UnregisterRegion("held2").ok());
  kill_and_wait(alive);
  listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 0);
  EXPECT_TRUE(alice_->FreePages(*pages).ok());
}

// The attack of registration by key: alice's POSIX shm object is listed in
// /dev/shm, so bob could register it under his own region name and read it
// through the server, and a client that shrank a registered object killed
// the server with SIGBUS. Both registrations are refused now, naming
// system.key; on a server that still takes them, the shrink below crashes it
// and the test fails.
TEST_F(RegionsTest, RegistrationByShmKeyIsRefusedSoNoTenantReadsAnothersObject) {
  const std::string key = absl::StrCat("/", shm_test::Name("posix"));
  const int64_t row_bytes = geo_.RowElems() * 2;
  const int64_t bytes = 4096;
  int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, bytes), 0);
  char* alices =
      static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(alices, MAP_FAILED);
  std::memset(alices, 0x3c, bytes);  // alice's secret

  absl::Status own = RegisterRaw(alice_.get(), "posix", "", 0, bytes, key);
  EXPECT_EQ(own.code(), absl::StatusCode::kInvalidArgument) << own;
  EXPECT_THAT(std::string(own.message()),
              HasSubstr("system.key: registration by POSIX shm name was removed"));
  absl::Status theirs = RegisterRaw(bob_.get(), "stolen", "", 0, bytes, key);
  EXPECT_EQ(theirs.code(), absl::StatusCode::kInvalidArgument) << theirs;
  auto pages = bob_->AllocatePages(1);
  ASSERT_TRUE(pages.ok()) << pages.status();
  const std::vector<int64_t> slots = {int64_t{(*pages)[0]} * geo_.page_size};
  if (theirs.ok()) {
    // A server that took the key: bob copies alice's bytes into his KV...
    ASSERT_TRUE(bob_->WriteKVFromRegions(0, slots, RegionRef{"stolen", 0, row_bytes},
                                         RegionRef{"stolen", 0, row_bytes})
                    .ok());
    auto read = bob_->ReadKV(0, slots);
    ASSERT_TRUE(read.ok());
    ADD_FAILURE() << "bob read alice's object through the server: first value "
                  << read->k[0];
    // ...and alice shrinking hers ends that server on its next access.
    ASSERT_EQ(ftruncate(fd, 0), 0);
    (void)bob_->WriteKVFromRegions(0, slots, RegionRef{"stolen", 0, row_bytes},
                                   RegionRef{"stolen", 0, row_bytes});
  }
  munmap(alices, bytes);
  close(fd);
  shm_unlink(key.c_str());
  EXPECT_TRUE(server_->Alive()) << server_->Output();
  EXPECT_TRUE(bob_->Health().ok());
  auto bobs = bob_->ListRegions();
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  EXPECT_TRUE(bobs->empty());
  EXPECT_TRUE(bob_->FreePages(*pages).ok());
}

// A tenant that shrinks, or tries to, the memory of a region in use: the
// memfd is sealed, so ftruncate fails; requests keep reading every byte and
// the server keeps serving.
TEST_F(RegionsTest, ATenantCannotShrinkItsRegionUnderTheServer) {
  const int64_t row_bytes = geo_.RowElems() * 2;
  auto pages = alice_->AllocatePages(1);
  ASSERT_TRUE(pages.ok()) << pages.status();
  const std::vector<int64_t> slots = {int64_t{(*pages)[0]} * geo_.page_size};
  auto shm = MakeShm("shrink", 3 * 4096);
  ASSERT_TRUE(shm && alice_->RegisterSystemRegion("s", *shm, 0, shm->size()).ok());
  std::mt19937_64 gen(5);
  const auto k = RandomHalves(gen, geo_.dtype, geo_.RowElems());
  const int64_t last = shm->size() - row_bytes;  // the last bytes of the last page
  Put(*shm, last, k.data(), row_bytes);
  EXPECT_EQ(ftruncate(shm->fd(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(ftruncate(shm->fd(), 4096), -1);
  EXPECT_EQ(fcntl(shm->fd(), F_ADD_SEALS, F_SEAL_WRITE), -1);  // the seals are final
  ASSERT_TRUE(alice_->WriteKVFromRegions(0, slots, RegionRef{"s", last, row_bytes},
                                         RegionRef{"s", last, row_bytes})
                  .ok());
  auto read = alice_->ReadKV(0, slots);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->k, k);
  EXPECT_TRUE(server_->Alive());
  EXPECT_TRUE(alice_->Health().ok());
  EXPECT_TRUE(alice_->UnregisterRegion("s").ok());
  EXPECT_TRUE(alice_->FreePages(*pages).ok());
}

// A raw connection to the server's region socket, for messages no client
// library sends (common/region_socket.h).
class RawRegionSocket {
 public:
  explicit RawRegionSocket(const std::string& name) {
    sockaddr_un addr{};
    socklen_t len = 0;
    EXPECT_TRUE(RegionSocketAddress(name, &addr, &len)) << name;
    fd_.reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    timeval tv{30, 0};
    setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    EXPECT_EQ(connect(fd_.get(), reinterpret_cast<const sockaddr*>(&addr), len), 0)
        << std::strerror(errno);
  }
  // The next message ("" at end of file).
  std::string Receive() {
    char buf[2048];
    const ssize_t n = recv(fd_.get(), buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }
  // The hello; false (and a failure) when the first message is not one.
  bool Hello(uint64_t incarnation) {
    const std::string m = Receive();
    RegionSocketHello hello;
    EXPECT_EQ(m.size(), sizeof(hello));
    if (m.size() != sizeof(hello)) return false;
    std::memcpy(&hello, m.data(), sizeof(hello));
    EXPECT_EQ(hello.magic, kRegionSocketMagic);
    EXPECT_EQ(hello.version, kRegionSocketVersion);
    EXPECT_EQ(hello.incarnation, incarnation);
    return true;
  }
  bool Send(const void* data, size_t bytes, const std::vector<int>& fds) {
    iovec iov{const_cast<void*>(data), bytes};
    std::vector<char> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(fds.size(), 1)));
    msghdr h{};
    h.msg_iov = &iov;
    h.msg_iovlen = 1;
    if (!fds.empty()) {
      h.msg_control = control.data();
      h.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&h);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    return sendmsg(fd_.get(), &h, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes);
  }
  // The reply's code and message.
  absl::Status Reply() {
    const std::string m = Receive();
    if (m.size() < 4) return absl::UnknownError(absl::StrCat("no reply (", m.size(), " bytes)"));
    int32_t code;
    std::memcpy(&code, m.data(), 4);
    return absl::Status(static_cast<absl::StatusCode>(code), m.substr(4));
  }
  int fd() const { return fd_.get(); }

 private:
  UniqueFd fd_;
};

RegionDepositMessage DepositOf(const std::string& token) {
  RegionDepositMessage m;
  std::memcpy(m.claim_token, token.data(), std::min(token.size(), kClaimTokenBytes));
  return m;
}

// Every malformed deposit is answered with its code and a message naming
// what is wrong, the connection closes, nothing is held, and the server
// keeps serving regions.
TEST_F(RegionsTest, TheRegionSocketRefusesBadDepositsAndKeepsServing) {
  const std::string socket_name = alice_->info().region_socket();
  EXPECT_EQ(socket_name, DefaultRegionSocket(std::stoi(server_->grpc_address().substr(
                             server_->grpc_address().rfind(':') + 1))));
  const uint64_t incarnation = alice_->info().incarnation();
  auto sealed = MakeShm("sealed", 4096);
  ASSERT_TRUE(sealed);
  const int memfd = sealed->fd();
  UniqueFd unsealed(memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(ftruncate(unsealed.get(), 4096), 0);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  const RegionDepositMessage good = DepositOf(std::string(16, 'g'));
  RegionDepositMessage bad_magic = good;
  bad_magic.magic = 0x12345678;
  RegionDepositMessage bad_version = good;
  bad_version.version = 9;
  const char small[8] = {};
  struct Case {
    std::string what;
    const void* data;
    size_t bytes;
    std::vector<int> fds;
    absl::StatusCode code;
    std::string text;
  } cases[] = {
      {"no descriptor", &good, sizeof(good), {}, absl::StatusCode::kInvalidArgument,
       "a deposit carries exactly one file descriptor (SCM_RIGHTS), the memfd; this one carried 0"},
      {"two descriptors", &good, sizeof(good), {memfd, memfd}, absl::StatusCode::kInvalidArgument,
       "this one carried 2"},
      {"short", small, sizeof(small), {memfd}, absl::StatusCode::kInvalidArgument,
       "a deposit is 24 bytes (magic, version, 16-byte claim token), not 8"},
      {"magic", &bad_magic, sizeof(bad_magic), {memfd}, absl::StatusCode::kInvalidArgument,
       "a deposit starts with magic 0x47455241 and version 1, not 0x12345678 and 1"},
      {"version", &bad_version, sizeof(bad_version), {memfd}, absl::StatusCode::kInvalidArgument,
       "not 0x47455241 and 9"},
      {"unsealed", &good, sizeof(good), {unsealed.get()}, absl::StatusCode::kInvalidArgument,
       "the memfd is not sealed against shrinking"},
      {"a pipe", &good, sizeof(good), {pipe_read.get()}, absl::StatusCode::kInvalidArgument,
       "the file descriptor is not a memfd"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RawRegionSocket raw(socket_name);
    if (!raw.Hello(incarnation)) continue;
    ASSERT_TRUE(raw.Send(c.data, c.bytes, c.fds));
    absl::Status reply = raw.Reply();
    EXPECT_EQ(reply.code(), c.code) << reply;
    EXPECT_THAT(std::string(reply.message()), HasSubstr(c.text));
    EXPECT_EQ(raw.Receive(), "");  // then the server closes
  }
  // A connection that goes without depositing, and a token claimed by none.
  { RawRegionSocket gone(socket_name); }
  absl::Status never = RegisterRaw(alice_.get(), "g", std::string(16, 'g'), 0, 4096);
  EXPECT_EQ(never.code(), absl::StatusCode::kNotFound) << never;

  // Through the client library: the refusal names the socket and the seal.
  absl::Status through_client = alice_->RegisterSystemRegionFd("u", unsealed.get(), 0, 4096);
  EXPECT_EQ(through_client.code(), absl::StatusCode::kInvalidArgument) << through_client;
  EXPECT_THAT(std::string(through_client.message()),
              HasSubstr(absl::StrCat("region socket ", socket_name,
                                     ": the memfd is not sealed against shrinking")));
  // A good deposit, by hand, claimed by the tenant that names its token.
  {
    RawRegionSocket raw(socket_name);
    ASSERT_TRUE(raw.Hello(incarnation));
    const RegionDepositMessage mine = DepositOf(std::string(16, 'm'));
    ASSERT_TRUE(raw.Send(&mine, sizeof(mine), {memfd}));
    EXPECT_TRUE(raw.Reply().ok());
    ASSERT_TRUE(RegisterRaw(alice_.get(), "m", std::string(16, 'm'), 0, 4096).ok());
    auto listed = alice_->ListRegions();
    ASSERT_TRUE(listed.ok());
    ASSERT_EQ(listed->size(), 1u);
    EXPECT_TRUE((*listed)[0].key_exists());
  }
  // Its holder (the raw connection) closed: reclaimed at the next list.
  auto listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
  EXPECT_TRUE(server_->Alive());
  ASSERT_TRUE(alice_->RegisterSystemRegion("after", *sealed, 0, 4096).ok());
  EXPECT_TRUE(alice_->UnregisterRegion("after").ok());
}

// A second tenant can take nothing of the first's memory: a spent token,
// or one nothing was deposited under, claims nothing, and alice's region
// stays hers.
TEST_F(RegionsTest, ASecondTenantCannotClaimTheFirstsDeposit) {
  auto shm = MakeShm("mine", 4096);
  ASSERT_TRUE(shm);
  std::memset(shm->data(), 0x2d, 4096);
  auto claim = DepositRegionFd(alice_->info().region_socket(), shm->fd(),
                               alice_->info().incarnation());
  ASSERT_TRUE(claim.ok()) << claim.status();
  ASSERT_TRUE(RegisterRaw(alice_.get(), "mine", claim->claim_token, 0, 4096).ok());
  // The token is spent: bob learning it now (it never leaves alice and the
  // server) claims nothing.
  absl::Status spent = RegisterRaw(bob_.get(), "bobs", claim->claim_token, 0, 4096);
  EXPECT_EQ(spent.code(), absl::StatusCode::kNotFound) << spent;
  auto pages = bob_->AllocatePages(1);
  ASSERT_TRUE(pages.ok()) << pages.status();
  const std::vector<int64_t> slots = {int64_t{(*pages)[0]} * geo_.page_size};
  const int64_t row_bytes = geo_.RowElems() * 2;
  absl::Status named = bob_->WriteKVFromRegions(0, slots, RegionRef{"mine", 0, row_bytes},
                                                RegionRef{"mine", 0, row_bytes});
  EXPECT_EQ(named.code(), absl::StatusCode::kPermissionDenied) << named;
  EXPECT_THAT(std::string(named.message()), HasSubstr("region 'mine' belongs to another tenant"));
  EXPECT_TRUE(bob_->FreePages(*pages).ok());
  auto bobs = bob_->ListRegions();
  ASSERT_TRUE(bobs.ok());
  EXPECT_TRUE(bobs->empty());
  EXPECT_TRUE(alice_->UnregisterRegion("mine").ok());
}

// Unauthenticated, so bounded: at most 64 connections wait for their
// deposit and at most 64 deposits wait for their claim; past either the
// client is told so (RESOURCE_EXHAUSTED), and room comes back as
// connections close and deposits are claimed.
TEST_F(RegionsTest, TheRegionSocketBoundsWhatItHolds) {
  const std::string socket_name = alice_->info().region_socket();
  const uint64_t incarnation = alice_->info().incarnation();
  auto shm = MakeShm("bounded", 4096);
  ASSERT_TRUE(shm);
  {
    std::vector<std::unique_ptr<RawRegionSocket>> waiting;
    for (int i = 0; i < 64; ++i) {
      waiting.push_back(std::make_unique<RawRegionSocket>(socket_name));
      ASSERT_TRUE(waiting.back()->Hello(incarnation));  // accepted
    }
    auto busy = DepositRegionFd(socket_name, shm->fd(), incarnation);
    EXPECT_EQ(busy.status().code(), absl::StatusCode::kResourceExhausted) << busy.status();
    EXPECT_THAT(std::string(busy.status().message()),
                HasSubstr("connections waiting for their deposit: at most 64"));
    waiting.pop_back();  // one leaves: room for one
    auto one = DepositRegionFd(socket_name, shm->fd(), incarnation);
    ASSERT_TRUE(one.ok()) << one.status();
  }
  std::vector<RegionClaim> claims;
  for (int i = 0; i < 64; ++i) {
    auto claim = DepositRegionFd(socket_name, shm->fd(), incarnation);
    ASSERT_TRUE(claim.ok()) << i << ": " << claim.status();
    claims.push_back(*std::move(claim));
  }
  auto full = DepositRegionFd(socket_name, shm->fd(), incarnation);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_THAT(std::string(full.status().message()),
              HasSubstr("deposits not yet claimed: at most 64"));
  // A claim makes room; so does a depositor that goes away.
  ASSERT_TRUE(RegisterRaw(alice_.get(), "c0", claims[0].claim_token, 0, 4096).ok());
  auto after_claim = DepositRegionFd(socket_name, shm->fd(), incarnation);
  ASSERT_TRUE(after_claim.ok()) << after_claim.status();
  claims[1].holder.reset();
  auto after_close = DepositRegionFd(socket_name, shm->fd(), incarnation);
  ASSERT_TRUE(after_close.ok()) << after_close.status();
  EXPECT_EQ(RegisterRaw(alice_.get(), "c1", claims[1].claim_token, 0, 4096).code(),
            absl::StatusCode::kNotFound);
  // The claims still held work; the server serves on.
  ASSERT_TRUE(RegisterRaw(alice_.get(), "c2", claims[2].claim_token, 0, 4096).ok());
  EXPECT_TRUE(alice_->Health().ok());
  EXPECT_TRUE(alice_->UnregisterRegion("c0").ok());
  EXPECT_TRUE(alice_->UnregisterRegion("c2").ok());
}

// --region_socket: a path works, and a socket file left by a server that
// was killed is replaced; a name a live server holds (a path or an abstract
// name), a path that is not a socket, or a name too long for a socket
// address stops a server at start with an error naming the flag. A server
// that stops removes its path.
TEST(RegionSocketFlagTest, PathsStaleSocketsAndTakenNames) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string base = absl::StrCat(dir != nullptr ? dir : "/tmp", "/attn_rs_", getpid());
  const std::string path = base + ".sock", file = base + ".file";
  unlink(path.c_str());
  {
    // Bound and closed without unlinking: what a killed server leaves.
    sockaddr_un addr{};
    socklen_t len = 0;
    ASSERT_TRUE(RegionSocketAddress(path, &addr, &len));
    UniqueFd stale(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    ASSERT_EQ(bind(stale.get(), reinterpret_cast<const sockaddr*>(&addr), len), 0);
  }
  ASSERT_EQ(access(path.c_str(), F_OK), 0);
  TestServerOptions options;
  options.extra_flags = {"--allow_shared_memory", "--region_socket=" + path};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions client_options;
  client_options.target = (*server)->grpc_address();
  auto client = Client::Connect(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->info().region_socket(), path);
  auto shm = MakeShm("path", 4096);
  ASSERT_TRUE(shm);
  ASSERT_TRUE((*client)->RegisterSystemRegion("p", *shm, 0, 4096).ok());

  auto taken = TestServer::Start(options);
  ASSERT_FALSE(taken.ok());
  EXPECT_THAT(std::string(taken.status().message()),
              HasSubstr(absl::StrCat("--region_socket=", path, ": the address is already in use")));
  const std::string abstract = absl::StrCat("@attn_rs_", getpid());
  TestServerOptions named;
  named.extra_flags = {"--allow_shared_memory", "--region_socket=" + abstract};
  auto first = TestServer::Start(named);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = TestServer::Start(named);
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr(absl::StrCat("--region_socket=", abstract,
                                     ": the address is already in use")));
  EXPECT_EQ((*first)->Stop(), 0);
  { std::ofstream(file) << "not a socket"; }
  TestServerOptions on_file;
  on_file.extra_flags = {"--allow_shared_memory", "--region_socket=" + file};
  auto refused = TestServer::Start(on_file);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrCat("--region_socket=", file,
                                     ": the path exists and is not a socket")));
  unlink(file.c_str());
  TestServerOptions too_long;
  too_long.extra_flags = {"--allow_shared_memory", "--region_socket=@" + std::string(200, 'x')};
  auto long_name = TestServer::Start(too_long);
  ASSERT_FALSE(long_name.ok());
  EXPECT_THAT(std::string(long_name.status().message()), HasSubstr("is not a Unix socket name"));

  // The first server served on throughout; stopping removes its path.
  auto listed = (*client)->ListRegions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->size(), 1u);
  client->reset();
  EXPECT_EQ((*server)->Stop(), 0);
  EXPECT_NE(access(path.c_str(), F_OK), 0);
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
  absl::Status s = (*client)->RegisterSystemRegion("r", *shm, 0, 4096);
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
