// Request channels against the real server (docs/transport.md, "Request
// channels"): Prefill requests sent through a ring in a system region give
// what the float64 reference gives, inline or with tensors in regions, with
// and without a plan, with several slots and threads in flight; every bad
// ring, header, slot and request is answered with its code and a message
// naming the field and the bound, and the server keeps serving; a channel
// closes with its region (unregistered, reclaimed, a killed client's) while
// requests in flight finish; and a channel of a server that restarted fails
// within its deadline instead of hanging.
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/channel.h"
#include "client/client.h"
#include "client/shared_memory.h"
#include "client/workload.h"
#include "common/channel_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/server_fixture.h"
#include "tests/integration/shm_test_util.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using shm_test::MakeShm;
using shm_test::Ref;

using ::testing::AnyOf;
using ::testing::HasSubstr;
using server_test::ExpectMatchesReference;

std::unique_ptr<Client> ConnectTo(const std::string& target, const std::string& token,
                                  double timeout_s = 60) {
  ClientOptions options;
  options.target = target;
  options.token = token;
  options.timeout_s = timeout_s;
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// Polls the server's /metrics until `name{labels}` reaches `at_least` (or
// 10 s pass); returns its last value.
double AwaitMetric(const TestServer& server, const std::string& name, const std::string& labels,
                   double at_least) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  double v = -1;
  do {
    auto body = HttpGet(server.metrics_address(), "/metrics");
    if (body.ok()) v = MetricValue(*body, name, labels).value_or(0);
    if (v >= at_least) return v;
    absl::SleepFor(absl::Milliseconds(1));
  } while (absl::Now() < deadline);
  return v;
}

double Metric(const TestServer& server, const std::string& name, const std::string& labels) {
  auto body = HttpGet(server.metrics_address(), "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  return body.ok() ? MetricValue(*body, name, labels).value_or(0) : -1;
}

// A ring driven by hand, slot by slot, as no client library would.
class RawRing {
 public:
  RawRing(char* base, int32_t slot_count, int32_t slot_bytes)
      : base_(base), slot_bytes_(slot_bytes), seq_(static_cast<size_t>(slot_count), 0) {
    std::memset(base, 0, static_cast<size_t>(ChannelBytes(slot_count, slot_bytes)));
    auto* h = header();
    h->magic = kChannelMagic;
    h->version = kChannelVersion;
    h->slot_count = static_cast<uint32_t>(slot_count);
    h->slot_bytes = static_cast<uint32_t>(slot_bytes);
  }
  ChannelHeader* header() { return reinterpret_cast<ChannelHeader*>(base_); }

  struct Answer {
    int32_t code = -1;
    std::string payload;
  };
  // Posts `bytes` in `slot` claiming `request_bytes` of them and waits (up
  // to 60 s) for the answer.
  Answer Post(int32_t slot, uint32_t method, const std::string& bytes, uint32_t request_bytes) {
    SlotControl* c = ChannelSlot(base_, slot_bytes_, slot);
    std::memcpy(ChannelPayload(base_, slot_bytes_, slot), bytes.data(),
                std::min<size_t>(bytes.size(), static_cast<size_t>(slot_bytes_)));
    c->method.store(method);
    c->request_bytes.store(request_bytes);
    const uint64_t seq = ++seq_[slot];
    c->request_seq.store(seq);
    if (header()->server_sleeping.load() != 0) {
      header()->server_wake.fetch_add(1);
      FutexWakeAll(&header()->server_wake);
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (c->response_seq.load() != seq && absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(100));
    }
    Answer a;
    if (c->response_seq.load() != seq) return a;
    a.code = c->status_code.load();
    a.payload.assign(ChannelPayload(base_, slot_bytes_, slot), c->response_bytes.load());
    return a;
  }
  Answer Post(int32_t slot, const std::string& bytes) {
    return Post(slot, 1, bytes, static_cast<uint32_t>(bytes.size()));
  }

 private:
  char* base_;
  int32_t slot_bytes_;
  std::vector<uint64_t> seq_;
};

// Tenants alice and bob, regions on, at most 3 channels per tenant, pollers
// that spin 50 us before they sleep (so that both paths run).
class ChannelTest : public ::testing::Test {
 protected:
  static constexpr int64_t kRingBytes = ChannelBytes(4, 256 << 10);
  static constexpr int64_t kShmBytes = 8 << 20;

  void SetUp() override {
    auto tokens = WriteTokensFile("tok-alice alice\ntok-bob bob\n");
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    tokens_path_ = *tokens;
    TestServerOptions options;
    options.extra_flags = {"--auth_tokens_file=" + tokens_path_, "--allow_shared_memory",
                           "--max_channels_per_tenant=3", "--channel_spin_us=50"};
    auto server = TestServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    alice_ = ConnectTo(server_->grpc_address(), "tok-alice");
    bob_ = ConnectTo(server_->grpc_address(), "tok-bob");
    ASSERT_TRUE(alice_ && bob_);
    geo_ = GeometryOf(alice_->info());
    shm_ = MakeShm("io", kShmBytes);
    ASSERT_TRUE(shm_);
    ASSERT_TRUE(alice_->RegisterSystemRegion("io", *shm_, 0, kShmBytes).ok());
  }
  void TearDown() override {
    alice_.reset();
    bob_.reset();
    if (server_ != nullptr) EXPECT_EQ(server_->Stop(), 0) << server_->Output();
    unlink(tokens_path_.c_str());
  }

  std::unique_ptr<RequestChannel> Open(int32_t slot_count = 4, int32_t slot_bytes = 256 << 10,
                                       int64_t offset = 0) {
    ChannelOptions options;
    options.slot_count = slot_count;
    options.slot_bytes = slot_bytes;
    auto channel = alice_->OpenChannel("io", shm_->data(), offset,
                                       ChannelBytes(slot_count, slot_bytes), options);
    EXPECT_TRUE(channel.ok()) << channel.status();
    return channel.ok() ? *std::move(channel) : nullptr;
  }

  grpc::Status OpenRaw(Client* as, const v1::RegionRef& ring, v1::OpenChannelResponse* out) {
    grpc::ClientContext ctx;
    as->PrepareContext(&ctx);
    v1::OpenChannelRequest req;
    *req.mutable_ring() = ring;
    return as->stub()->OpenChannel(&ctx, req, out);
  }
  grpc::Status CloseRaw(Client* as, uint64_t id) {
    grpc::ClientContext ctx;
    as->PrepareContext(&ctx);
    v1::CloseChannelRequest req;
    req.set_channel_id(id);
    v1::CloseChannelResponse resp;
    return as->stub()->CloseChannel(&ctx, req, &resp);
  }

  // Pages for `spec`, filled with random K/V over gRPC and mirrored.
  std::vector<int32_t> Fill(KvMirror& mirror, std::mt19937_64& gen, const WorkloadSpec& spec) {
    auto pages = alice_->AllocatePages(static_cast<int32_t>(PagesNeeded(geo_, spec)));
    EXPECT_TRUE(pages.ok()) << pages.status();
    if (!pages.ok()) return {};
    server_test::FillPages(*alice_, mirror, gen, spec.layer, *pages);
    return *pages;
  }

  std::string tokens_path_;
  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> alice_, bob_;
  std::unique_ptr<SharedMemory> shm_;
  KvGeometry geo_;
};

TEST_F(ChannelTest, PrefillAndDecodeThroughAChannelMatchTheReference) {
  std::mt19937_64 gen(101);
  KvMirror mirror(geo_);
  WorkloadSpec prefill_spec;
  prefill_spec.batch = 5;
  prefill_spec.max_q_len = 24;
  prefill_spec.max_kv_len = 120;
  const std::vector<int32_t> pages = Fill(mirror, gen, prefill_spec);
  ASSERT_FALSE(pages.empty());
  auto channel = Open();
  ASSERT_NE(channel, nullptr);
  EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 1);

  // Prefill, every tensor inline; the result's vectors hold garbage first.
  const PrefillInputs in = RandomPrefill(gen, geo_, prefill_spec, pages);
  PrefillResult got;
  got.o.assign(in.q.size(), 0x7fc1);
  got.lse.assign(in.total_q() * geo_.num_qo_heads, std::nanf(""));
  absl::Status s = channel->PrefillInto(ArgsOf(in), &got);
  ASSERT_TRUE(s.ok()) << s;
  ExpectMatchesReference(mirror, in, got);
  const std::string stages = "attnserve_request_stage_seconds_count";
  const double sends_before_grpc = Metric(*server_, stages, "stage=\"send\"");
  auto over_grpc = alice_->Prefill(ArgsOf(in));
  ASSERT_TRUE(over_grpc.ok()) << over_grpc.status();
  // The gRPC call's send stage is observed when the server learns the
  // answer went out, which may be after the client has it: awaited, so the
  // channel rounds below start from a settled count.
  EXPECT_EQ(AwaitMetric(*server_, stages, "stage=\"send\"", sends_before_grpc + 1), sends_before_grpc + 1);
  EXPECT_EQ(got.o, over_grpc->o);
  EXPECT_EQ(got.lse, over_grpc->lse);
  EXPECT_EQ(got.incarnation, alice_->incarnation());

  // Decode of 8 sequences with a plan, q, output and LSE in the region
  // behind the ring, the outputs poisoned first.
  WorkloadSpec decode_spec;
  decode_spec.batch = 8;
  decode_spec.max_q_len = 1;
  decode_spec.max_kv_len = 120;
  const PrefillInputs dec = RandomPrefill(gen, geo_, decode_spec, pages);
  PlanLayout layout;
  layout.qo_indptr = dec.qo_indptr;
  layout.kv_indptr = dec.kv_indptr;
  layout.kv_indices = dec.kv_indices;
  layout.kv_last_page_len = dec.kv_last_page_len;
  auto plan = alice_->CreatePlan(layout);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const int64_t q_bytes = static_cast<int64_t>(dec.q.size()) * 2;
  const int64_t lse_bytes = dec.total_q() * geo_.num_qo_heads * 4;
  const int64_t q_at = kRingBytes, o_at = q_at + q_bytes + 4096, lse_at = o_at + q_bytes + 4096;
  std::memcpy(shm_->data() + q_at, dec.q.data(), q_bytes);
  // A channel request reports the request stages of the gRPC path but
  // `send` (nothing goes through gRPC): each of the 3 rounds adds one.
  std::map<std::string, double> stage_before;
  for (const char* stage : {"parse", "admit", "respond", "send"}) {
    stage_before[stage] = Metric(*server_, stages, absl::StrCat("stage=\"", stage, "\""));
  }
  const double ok_before = server_test::OkPrefills(*HttpGet(server_->metrics_address(), "/metrics"));
  for (int round = 0; round < 3; ++round) {
    std::memset(shm_->data() + o_at, 0xff, lse_at + lse_bytes - o_at);  // NaN everywhere
    PrefillArgs args;
    args.plan_id = *plan;
    args.causal = dec.causal;
    args.lse_base_e = dec.lse_base_e;
    args.q_region = RegionRef{"io", q_at, q_bytes};
    args.q_rows = dec.total_q();
    args.output_region = RegionRef{"io", o_at, q_bytes};
    args.lse_region = RegionRef{"io", lse_at, lse_bytes};
    auto out = channel->Prefill(args);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(out->o.empty());
    EXPECT_TRUE(out->lse.empty());
    PrefillResult from_region;
    from_region.o.assign(reinterpret_cast<const uint16_t*>(shm_->data() + o_at),
                         reinterpret_cast<const uint16_t*>(shm_->data() + o_at + q_bytes));
    from_region.lse.assign(reinterpret_cast<const float*>(shm_->data() + lse_at),
                           reinterpret_cast<const float*>(shm_->data() + lse_at + lse_bytes));
    ExpectMatchesReference(mirror, dec, from_region);
    // Counted before its answer was published: no waiting.
    EXPECT_EQ(server_test::OkPrefills(*HttpGet(server_->metrics_address(), "/metrics")),
              ok_before + round + 1);
  }
  // admit is observed once the request is queued, which may be after its
  // answer arrived: awaited.
  for (const char* stage : {"parse", "admit", "respond"}) {
    const std::string label = absl::StrCat("stage=\"", stage, "\"");
    EXPECT_EQ(AwaitMetric(*server_, stages, label, stage_before[stage] + 3), stage_before[stage] + 3) << stage;
  }
  EXPECT_EQ(Metric(*server_, stages, "stage=\"send\""), stage_before["send"]);
  EXPECT_TRUE(alice_->ReleasePlan(*plan).ok());
  EXPECT_GE(Metric(*server_, "attnserve_transfer_bytes_total", "direction=\"in\",path=\"system\""),
            3 * q_bytes);
  EXPECT_GE(server_test::OkPrefills(*HttpGet(server_->metrics_address(), "/metrics")), 5);

  // Closed: the gauge drops, and the channel refuses further calls.
  ASSERT_TRUE(channel->Close().ok());
  EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 0);
  EXPECT_EQ(channel->Prefill(ArgsOf(in)).status().code(), absl::StatusCode::kFailedPrecondition);
}

// More threads than slots, each with its own requests (prefill and decode
// shapes, inline and in regions), all in flight at once.
TEST_F(ChannelTest, ManyThreadsShareTheSlotsOfOneChannel) {
  std::mt19937_64 gen(7);
  KvMirror mirror(geo_);
  WorkloadSpec spec;
  spec.batch = 4;
  spec.max_q_len = 12;
  spec.max_kv_len = 90;
  const std::vector<int32_t> pages = Fill(mirror, gen, spec);
  ASSERT_FALSE(pages.empty());
  auto channel = Open(/*slot_count=*/3);
  ASSERT_NE(channel, nullptr);
  constexpr int kThreads = 5, kRequests = 6;
  constexpr int64_t kArea = 1 << 20;  // each thread's bytes behind the ring
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 tgen(1000 + t);
      WorkloadSpec mine = spec;
      mine.max_q_len = t % 2 == 0 ? 1 : 12;
      char* area = shm_->data() + kRingBytes + t * kArea;
      const int64_t area_at = kRingBytes + t * kArea;
      for (int i = 0; i < kRequests; ++i) {
        const PrefillInputs in = RandomPrefill(tgen, geo_, mine, pages);
        PrefillArgs args = ArgsOf(in);
        PrefillResult got;
        const int64_t q_bytes = static_cast<int64_t>(in.q.size()) * 2;
        const int64_t lse_bytes = in.total_q() * geo_.num_qo_heads * 4;
        const bool regions = i % 2 == 1;
        if (regions) {
          std::memcpy(area, in.q.data(), q_bytes);
          std::memset(area + q_bytes, 0xff, q_bytes + lse_bytes);
          args.q = {};
          args.q_region = RegionRef{"io", area_at, q_bytes};
          args.q_rows = in.total_q();
          args.output_region = RegionRef{"io", area_at + q_bytes, q_bytes};
          args.lse_region = RegionRef{"io", area_at + 2 * q_bytes, lse_bytes};
        }
        absl::Status s = channel->PrefillInto(args, &got);
        EXPECT_TRUE(s.ok()) << s;
        if (!s.ok()) continue;
        if (regions) {
          got.o.assign(reinterpret_cast<const uint16_t*>(area + q_bytes),
                       reinterpret_cast<const uint16_t*>(area + 2 * q_bytes));
          got.lse.assign(reinterpret_cast<const float*>(area + 2 * q_bytes),
                         reinterpret_cast<const float*>(area + 2 * q_bytes + lse_bytes));
        }
        ExpectMatchesReference(mirror, in, got);
        ok.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * kRequests);
}

TEST_F(ChannelTest, OpenAndCloseErrorsNameTheFieldAndTheBound) {
  auto theirs = MakeShm("bob", 1 << 16);
  ASSERT_TRUE(theirs && bob_->RegisterSystemRegion("bobs", *theirs, 0, 1 << 16).ok());
  const int64_t ring = ChannelBytes(2, 4096);
  RawRing raw(shm_->data(), 2, 4096);
  struct Case {
    std::string what;
    std::function<void()> before;
    v1::RegionRef ref;
    grpc::StatusCode code;
    std::string text;
  };
  RawRing* r = &raw;
  const std::vector<Case> cases = {
      {"unknown region", [] {}, Ref("nope", 0, ring), grpc::StatusCode::NOT_FOUND,
       "ring.name: region 'nope' is not registered"},
      {"another tenant's region", [] {}, Ref("bobs", 0, ring), grpc::StatusCode::PERMISSION_DENIED,
       "ring.name: region 'bobs' belongs to another tenant"},
      {"misaligned", [] {}, Ref("io", 32, ring), grpc::StatusCode::INVALID_ARGUMENT,
       "ring.offset=32: the ring's address in region 'io' must be a multiple of 64 bytes"},
      {"past the region", [] {}, Ref("io", kShmBytes - 4096, ring),
       grpc::StatusCode::INVALID_ARGUMENT, "exceeds the size of region 'io'"},
      {"layout past the range", [] {}, Ref("io", 0, ring - 64), grpc::StatusCode::INVALID_ARGUMENT,
       "is less than the ring's layout"},
      {"bad magic", [r] { r->header()->magic = 0xdeadbeef; }, Ref("io", 0, ring),
       grpc::StatusCode::INVALID_ARGUMENT, "ring header magic=0xdeadbeef, expected 0x4e484341"},
      {"bad version", [r] { r->header()->version = 9; }, Ref("io", 0, ring),
       grpc::StatusCode::INVALID_ARGUMENT, "ring header version=9"},
      {"no slots", [r] { r->header()->slot_count = 0; }, Ref("io", 0, ring),
       grpc::StatusCode::INVALID_ARGUMENT, "ring header slot_count=0 out of range [1, 64]"},
      {"small slots", [r] { r->header()->slot_bytes = 1024; }, Ref("io", 0, ring),
       grpc::StatusCode::INVALID_ARGUMENT, "ring header slot_bytes=1024 out of range [4096, "},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RawRing fresh(shm_->data(), 2, 4096);
    c.before();
    v1::OpenChannelResponse resp;
    grpc::Status s = OpenRaw(alice_.get(), c.ref, &resp);
    EXPECT_EQ(s.error_code(), c.code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.text));
  }
  EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 0);

  // The cap; another tenant's channel; an unknown channel.
  std::vector<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    RawRing fresh(shm_->data() + i * ring, 2, 4096);
    v1::OpenChannelResponse resp;
    grpc::Status s = OpenRaw(alice_.get(), Ref("io", i * ring, ring), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_NE(resp.channel_id(), 0u);
    EXPECT_EQ(resp.slot_count(), 2u);
    EXPECT_EQ(resp.slot_bytes(), 4096u);
    ids.push_back(resp.channel_id());
  }
  {
    RawRing fresh(shm_->data() + 3 * ring, 2, 4096);
    v1::OpenChannelResponse resp;
    grpc::Status s = OpenRaw(alice_.get(), Ref("io", 3 * ring, ring), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("at most 3 (--max_channels_per_tenant)"));
  }
  EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 3);
  grpc::Status s = CloseRaw(bob_.get(), ids[0]);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("belongs to another tenant"));
  s = CloseRaw(alice_.get(), ids[0] ^ 0x5a5a);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("names no open channel"));
  for (uint64_t id : ids) ASSERT_TRUE(CloseRaw(alice_.get(), id).ok());
  EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 0);
  EXPECT_EQ(CloseRaw(alice_.get(), ids[0]).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(alice_->Health().ok());
}

// Two channels on one ring would have two pollers take each other's
// requests and answer into each other's slots (as after an OpenChannel whose
// reply was lost, then retried): a ring that overlaps an open channel's is
// refused, naming that channel, and the range is free again once it closes.
TEST_F(ChannelTest, ARingOverlappingAnOpenChannelsIsRefused) {
  const int64_t ring = ChannelBytes(2, 4096);
  v1::OpenChannelResponse first;
  {
    RawRing fresh(shm_->data(), 2, 4096);
    grpc::Status s = OpenRaw(alice_.get(), Ref("io", 0, ring), &first);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  char id[17];
  std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(first.channel_id()));
  // Refused whatever the bytes hold: no header is written there (they are
  // the open ring's header and slots), so the overlap is found before the
  // header is read. Each range is [offset, offset + bytes).
  const std::pair<int64_t, int64_t> overlapping[] = {
      {0, ring}, {64, ring}, {ring - 64, ring}, {128, 256}, {ring - 64, 64}};
  for (const auto& [offset, bytes] : overlapping) {
    SCOPED_TRACE(offset);
    v1::OpenChannelResponse resp;
    grpc::Status s = OpenRaw(alice_.get(), Ref("io", offset, bytes), &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(std::string("overlap the ring of open channel ") + id));
    EXPECT_THAT(s.error_message(),
                HasSubstr(absl::StrCat("bytes [", offset, ", ", offset + bytes, ") of region 'io'")));
  }
  EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 1);
  {  // the next bytes are free
    RawRing fresh(shm_->data() + ring, 2, 4096);
    v1::OpenChannelResponse resp;
    grpc::Status s = OpenRaw(alice_.get(), Ref("io", ring, ring), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(CloseRaw(alice_.get(), resp.channel_id()).ok());
  }
  ASSERT_TRUE(CloseRaw(alice_.get(), first.channel_id()).ok());
  {  // and the first ring's, once its channel closed
    RawRing fresh(shm_->data(), 2, 4096);
    v1::OpenChannelResponse resp;
    grpc::Status s = OpenRaw(alice_.get(), Ref("io", 0, ring), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_TRUE(CloseRaw(alice_.get(), resp.channel_id()).ok());
  }
  // The C++ client refuses its own open channel's bytes before writing
  // anything over them.
  auto open = alice_->OpenChannel("io", shm_->data(), 0, ring, ChannelOptions{2, 4096, 100});
  ASSERT_TRUE(open.ok()) << open.status();
  auto over = alice_->OpenChannel("io", shm_->data(), 64, ring, ChannelOptions{2, 4096, 100});
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument) << over.status();
  EXPECT_THAT(std::string(over.status().message()),
              HasSubstr(absl::StrCat("overlap the ring of open channel ", (*open)->id(), " of this client")));
  // (The refused open wrote no header at byte 64, inside the open ring.)
  EXPECT_NE(reinterpret_cast<const ChannelHeader*>(shm_->data() + 64)->magic, kChannelMagic);
  ASSERT_TRUE((*open)->Close().ok());
  auto again = alice_->OpenChannel("io", shm_->data(), 64, ring, ChannelOptions{2, 4096, 100});
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE((*again)->Close().ok());
  EXPECT_TRUE(alice_->Health().ok());
}

// An answer written over an open channel's ring would overwrite its header
// and slots while the channel's poller reads them: an output range there is
// refused, over gRPC and through the channel alike, naming the channel, and
// the channel keeps serving; the bytes just past the ring take the answer.
TEST_F(ChannelTest, AnOutputOverAnOpenChannelsRingIsRefused) {
  std::mt19937_64 gen(29);
  KvMirror mirror(geo_);
  WorkloadSpec spec;
  spec.batch = 2;
  spec.max_q_len = 4;
  spec.max_kv_len = 40;
  const std::vector<int32_t> pages = Fill(mirror, gen, spec);
  ASSERT_FALSE(pages.empty());
  auto channel = Open();
  ASSERT_NE(channel, nullptr);
  char id[17];
  std::snprintf(id, sizeof(id), "%016llx", static_cast<unsigned long long>(channel->id()));
  const PrefillInputs in = RandomPrefill(gen, geo_, spec, pages);
  const int64_t q_bytes = static_cast<int64_t>(in.q.size()) * 2;
  const int64_t lse_bytes = in.total_q() * geo_.num_qo_heads * 4;
  for (int64_t at : {int64_t{0}, int64_t{4096}, kRingBytes - 64}) {
    SCOPED_TRACE(at);
    // (The other output past the ring: the two go together.)
    PrefillArgs o_args = ArgsOf(in);
    o_args.output_region = RegionRef{"io", at, q_bytes};
    o_args.lse_region = RegionRef{"io", kRingBytes, lse_bytes};
    PrefillArgs lse_args = ArgsOf(in);
    lse_args.output_region = RegionRef{"io", kRingBytes, q_bytes};
    lse_args.lse_region = RegionRef{"io", at, lse_bytes};
    for (const auto& [args, field] : {std::pair{o_args, "output_region ["}, std::pair{lse_args, "lse_region ["}}) {
      absl::Status grpc_status = alice_->Prefill(args).status();
      absl::Status channel_status = channel->Prefill(args).status();
      for (const absl::Status& s : {grpc_status, channel_status}) {
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
        EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat(field, at, ", ")));
        EXPECT_THAT(std::string(s.message()), HasSubstr(std::string("overlaps the ring of open channel ") + id));
      }
    }
  }
  EXPECT_EQ(reinterpret_cast<const ChannelHeader*>(shm_->data())->magic, kChannelMagic);
  // The channel still serves, and the bytes past its ring take an answer.
  PrefillResult got;
  ASSERT_TRUE(channel->PrefillInto(ArgsOf(in), &got).ok());
  ExpectMatchesReference(mirror, in, got);
  PrefillArgs past = ArgsOf(in);
  past.output_region = RegionRef{"io", kRingBytes, q_bytes};
  past.lse_region = RegionRef{"io", kRingBytes + q_bytes, lse_bytes};
  std::memset(shm_->data() + kRingBytes, 0xff, q_bytes + lse_bytes);
  auto out = alice_->Prefill(past);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(std::memcmp(shm_->data() + kRingBytes, got.o.data(), q_bytes), 0);
  EXPECT_EQ(std::memcmp(shm_->data() + kRingBytes + q_bytes, got.lse.data(), lse_bytes), 0);
  // Closed, its ring's bytes are the region's again.
  ASSERT_TRUE(channel->Close().ok());
  PrefillArgs over = ArgsOf(in);
  over.output_region = RegionRef{"io", 0, q_bytes};
  over.lse_region = RegionRef{"io", q_bytes, lse_bytes};
  EXPECT_TRUE(alice_->Prefill(over).ok());
  EXPECT_TRUE(alice_->Health().ok());
}

TEST_F(ChannelTest, BadSlotContentsAreAnsweredInTheSlotAndTheServerKeepsServing) {
  std::mt19937_64 gen(5);
  KvMirror mirror(geo_);
  WorkloadSpec spec;
  spec.batch = 1;
  spec.max_q_len = 3;
  spec.max_kv_len = 40;
  const std::vector<int32_t> pages = Fill(mirror, gen, spec);
  ASSERT_FALSE(pages.empty());
  PrefillInputs in = RandomPrefill(gen, geo_, spec, pages);
  // A good request, serialized as the API says: q inline.
  const std::string good = server_test::PrefillProto(geo_, in, {}, {}, {}).SerializeAsString();
  ASSERT_LT(good.size(), 4096u);

  const int64_t ring = ChannelBytes(2, 4096);
  RawRing raw(shm_->data(), 2, 4096);
  v1::OpenChannelResponse opened;
  grpc::Status open = OpenRaw(alice_.get(), Ref("io", 0, ring), &opened);
  ASSERT_TRUE(open.ok()) << open.error_message();

  auto expect_good = [&](int32_t slot) {
    RawRing::Answer a = raw.Post(slot, good);
    ASSERT_EQ(a.code, 0) << a.payload;
    v1::PrefillResponse resp;
    ASSERT_TRUE(resp.ParseFromString(a.payload));
    PrefillResult got;
    got.o.resize(resp.output().data().size() / 2);
    std::memcpy(got.o.data(), resp.output().data().data(), resp.output().data().size());
    got.lse.resize(resp.lse().data().size() / 4);
    std::memcpy(got.lse.data(), resp.lse().data().data(), resp.lse().data().size());
    ExpectMatchesReference(mirror, in, got);
    EXPECT_EQ(resp.incarnation(), opened.incarnation());
  };
  expect_good(0);

  struct Case {
    std::string what;
    uint32_t method;
    std::string bytes;
    uint32_t request_bytes;
    int32_t code;
    std::string text;
  } cases[] = {
      {"request_bytes past the slot", 1, good, 4097, 3,
       "request_bytes=4097 exceeds the ring's slot_bytes=4096"},
      {"request_bytes at UINT32_MAX", 1, good, 0xffffffffu, 3, "request_bytes=4294967295"},
      {"unknown method", 7, good, static_cast<uint32_t>(good.size()), 3,
       "method=7: a channel serves only method 1 (Prefill)"},
      {"method 0", 0, good, static_cast<uint32_t>(good.size()), 3, "method=0"},
      {"garbage bytes", 1, std::string("\xff\xff\xff\xff\x0f\x12\x80", 7), 7, 3,
       "attnserve.v1.PrefillRequest"},
      {"a field claiming more than follows", 1, std::string("\x12\xff\xff\x03", 4), 4, 3,
       "attnserve.v1.PrefillRequest"},
      {"truncated request", 1, good, static_cast<uint32_t>(good.size() / 2), 3, "PrefillRequest"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RawRing::Answer a = raw.Post(1, c.method, c.bytes, c.request_bytes);
    EXPECT_EQ(a.code, c.code) << a.payload;
    EXPECT_THAT(a.payload, HasSubstr(c.text));
    expect_good(0);
  }

  // The header changed after OpenChannel: the server keeps its copy.
  raw.header()->slot_count = 64;
  raw.header()->slot_bytes = 16 << 20;
  raw.header()->magic = 0;
  std::string big(6000, '\0');
  RawRing::Answer a = raw.Post(1, 1, big, 6000);
  EXPECT_EQ(a.code, 3) << a.payload;
  EXPECT_THAT(a.payload, HasSubstr("request_bytes=6000 exceeds the ring's slot_bytes=4096"));
  expect_good(1);
  ASSERT_TRUE(CloseRaw(alice_.get(), opened.channel_id()).ok());

  // A response that does not fit: RESOURCE_EXHAUSTED naming slot_bytes and
  // the size needed, and the output is not written.
  auto small = Open(/*slot_count=*/1, /*slot_bytes=*/4096);
  ASSERT_NE(small, nullptr);
  WorkloadSpec wide = spec;
  wide.max_q_len = 12;
  PrefillInputs big_in = RandomPrefill(gen, geo_, wide, pages);
  while (big_in.total_q() * geo_.num_qo_heads * geo_.head_dim * 2 <= 4096) {
    big_in = RandomPrefill(gen, geo_, wide, pages);
  }
  const int64_t q_bytes = static_cast<int64_t>(big_in.q.size()) * 2;
  const int64_t q_at = 64 << 10;
  std::memcpy(shm_->data() + q_at, big_in.q.data(), q_bytes);
  PrefillArgs args = ArgsOf(big_in);
  args.q = {};
  args.q_region = RegionRef{"io", q_at, q_bytes};
  args.q_rows = big_in.total_q();
  absl::Status too_big = small->Prefill(args).status();
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted) << too_big;
  EXPECT_THAT(std::string(too_big.message()), HasSubstr("more than the ring's slot_bytes=4096"));
  EXPECT_THAT(std::string(too_big.message()), HasSubstr("slots of at least"));
  // A request that does not fit is refused by the client before it is sent.
  absl::Status unsent = small->Prefill(ArgsOf(big_in)).status();
  EXPECT_EQ(unsent.code(), absl::StatusCode::kInvalidArgument) << unsent;
  EXPECT_THAT(std::string(unsent.message()), HasSubstr("slot_bytes=4096"));
  // Its outputs in regions, the same request fits and is right.
  const int64_t lse_bytes = big_in.total_q() * geo_.num_qo_heads * 4;
  args.output_region = RegionRef{"io", q_at + q_bytes, q_bytes};
  args.lse_region = RegionRef{"io", q_at + 2 * q_bytes, lse_bytes};
  auto fits = small->Prefill(args);
  ASSERT_TRUE(fits.ok()) << fits.status();
  PrefillResult from_region;
  from_region.o.assign(reinterpret_cast<const uint16_t*>(shm_->data() + q_at + q_bytes),
                       reinterpret_cast<const uint16_t*>(shm_->data() + q_at + 2 * q_bytes));
  from_region.lse.assign(reinterpret_cast<const float*>(shm_->data() + q_at + 2 * q_bytes),
                         reinterpret_cast<const float*>(shm_->data() + q_at + 2 * q_bytes + lse_bytes));
  ExpectMatchesReference(mirror, big_in, from_region);
  // Errors of the core come back through the slot as over gRPC.
  PrefillArgs stale = args;
  stale.expected_incarnation = alice_->incarnation() ^ 1;
  EXPECT_EQ(small->Prefill(stale).status().code(), absl::StatusCode::kFailedPrecondition);
  PrefillArgs not_mine = args;
  not_mine.q_region = RegionRef{"nope", 0, q_bytes};
  absl::Status unknown = small->Prefill(not_mine).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("q.region.name"));
  EXPECT_TRUE(alice_->Health().ok());
  EXPECT_GE(Metric(*server_, "attnserve_requests_total",
                   "code=\"INVALID_ARGUMENT\",method=\"Prefill\",shape=\"prefill\""),
            7);
}

// A long request in flight when its channel's region is unregistered (or
// the channel closed) finishes and is right; the channel is closed after it.
TEST_F(ChannelTest, UnregisterOrCloseWithARequestInFlight) {
  std::mt19937_64 gen(9);
  KvMirror mirror(geo_);
  WorkloadSpec spec;
  spec.batch = 2;
  spec.max_q_len = 256;
  spec.max_kv_len = 1024;
  const std::vector<int32_t> pages = Fill(mirror, gen, spec);
  ASSERT_FALSE(pages.empty());
  for (const bool unregister : {false, true}) {
    SCOPED_TRACE(unregister ? "UnregisterRegion" : "CloseChannel");
    auto channel = Open();
    ASSERT_NE(channel, nullptr);
    const PrefillInputs in = RandomPrefill(gen, geo_, spec, pages);
    const int64_t q_bytes = static_cast<int64_t>(in.q.size()) * 2;
    const int64_t lse_bytes = in.total_q() * geo_.num_qo_heads * 4;
    const int64_t q_at = kRingBytes, o_at = q_at + q_bytes, lse_at = o_at + q_bytes;
    std::memcpy(shm_->data() + q_at, in.q.data(), q_bytes);
    std::memset(shm_->data() + o_at, 0xff, q_bytes + lse_bytes);
    PrefillArgs args = ArgsOf(in);
    args.q = {};
    args.q_region = RegionRef{"io", q_at, q_bytes};
    args.q_rows = in.total_q();
    args.output_region = RegionRef{"io", o_at, q_bytes};
    args.lse_region = RegionRef{"io", lse_at, lse_bytes};
    // The request's regions are resolved and held before it is queued; the
    // queue-wait count rises when its batch starts. (The in-flight gauge
    // rises earlier, as the poller takes the request: before the regions.)
    const std::string started = "attnserve_queue_wait_seconds_count";
    const double before = Metric(*server_, started, "");
    absl::Status result;
    std::thread caller([&] { result = channel->Prefill(args).status(); });
    EXPECT_GE(AwaitMetric(*server_, started, "", before + 1), before + 1) << "the request's batch never started";
    if (unregister) {
      ASSERT_TRUE(alice_->UnregisterRegion("io").ok());
    } else {
      ASSERT_TRUE(CloseRaw(alice_.get(), channel->id()).ok());
    }
    caller.join();
    ASSERT_TRUE(result.ok()) << result;
    PrefillResult got;
    got.o.assign(reinterpret_cast<const uint16_t*>(shm_->data() + o_at),
                 reinterpret_cast<const uint16_t*>(shm_->data() + o_at + q_bytes));
    got.lse.assign(reinterpret_cast<const float*>(shm_->data() + lse_at),
                   reinterpret_cast<const float*>(shm_->data() + lse_at + lse_bytes));
    ExpectMatchesReference(mirror, in, got);
    EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 0);
    // The next call is never taken: the ring says closed.
    WorkloadSpec small = spec;
    small.max_q_len = 2;
    const PrefillInputs next_in = RandomPrefill(gen, geo_, small, pages);
    absl::Status next = channel->Prefill(ArgsOf(next_in)).status();
    EXPECT_EQ(next.code(), absl::StatusCode::kUnavailable) << next;
    EXPECT_THAT(std::string(next.message()), HasSubstr("open a new channel"));
  }
  // Still serving, channels included.
  ASSERT_TRUE(alice_->RegisterSystemRegion("io", *shm_, 0, kShmBytes).ok());
  auto again = Open();
  ASSERT_NE(again, nullptr);
  WorkloadSpec small = spec;
  small.max_q_len = 4;
  const PrefillInputs in = RandomPrefill(gen, geo_, small, pages);
  auto got = again->Prefill(ArgsOf(in));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatchesReference(mirror, in, *got);
}

// Client processes open channels and are killed: the channels cost nothing
// until their regions go (unregistered, or reclaimed at the tenant's next
// ListRegions now that their clients are gone).
TEST_F(ChannelTest, AKilledClientsChannelClosesWithItsRegion) {
  // Both run before either dies: a registration of the tenant's reclaims
  // the idle regions of its clients that are gone.
  std::vector<pid_t> pids;
  for (const char* name : {"held1", "held2"}) {
    int pipe_fds[2];
    ASSERT_EQ(pipe(pipe_fds), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(pipe_fds[1], 1);
      close(pipe_fds[0]);
      execl(REGION_HOLDER_BIN, REGION_HOLDER_BIN, server_->grpc_address().c_str(), "tok-alice",
            name, "65536", "3", "channel", nullptr);
      _exit(127);
    }
    pids.push_back(pid);
    close(pipe_fds[1]);
    char buf[16] = {};
    const ssize_t got = read(pipe_fds[0], buf, sizeof(buf) - 1);
    close(pipe_fds[0]);
    EXPECT_GT(got, 0);
    EXPECT_EQ(std::string(buf), "ready\n");
  }
  for (const pid_t pid : pids) {
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status));
  }
  EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 2);
  ASSERT_TRUE(alice_->UnregisterRegion("held1").ok());
  EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 1);
  auto listed = alice_->ListRegions();  // reclaims held2: its client is gone
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name(), "io");
  EXPECT_EQ(Metric(*server_, "attnserve_open_channels", "tenant=\"alice\""), 0);

  // Still serving through a channel of this client.
  std::mt19937_64 gen(4);
  KvMirror mirror(geo_);
  WorkloadSpec spec;
  spec.batch = 3;
  spec.max_q_len = 5;
  spec.max_kv_len = 50;
  const std::vector<int32_t> pages = Fill(mirror, gen, spec);
  auto channel = Open();
  ASSERT_NE(channel, nullptr);
  const PrefillInputs in = RandomPrefill(gen, geo_, spec, pages);
  auto got = channel->Prefill(ArgsOf(in));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatchesReference(mirror, in, *got);
}

TEST(ChannelOffTest, WithoutSharedMemoryChannelsAreRefused) {
  auto server = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = ConnectTo((*server)->grpc_address(), "");
  ASSERT_TRUE(client);
  auto shm = MakeShm("off", 1 << 16);
  ASSERT_TRUE(shm);
  auto channel = client->OpenChannel("r", shm->data(), 0, 1 << 16, ChannelOptions{4, 4096, 100});
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kFailedPrecondition) << channel.status();
  EXPECT_THAT(std::string(channel.status().message()), HasSubstr("--allow_shared_memory"));
  EXPECT_TRUE(client->Health().ok());
  EXPECT_EQ((*server)->Stop(), 0);
}

// The server dies (SIGKILL: nothing marks the ring closed) and restarts on
// the same port: the old ring is never polled again, so the client's next
// call fails within its deadline saying that the channel must be reopened,
// and the new server's data is untouched.
// What the stand-alone tests below start from: `client`'s pages for `spec`
// filled with random K/V (kept in `mirror`), an 8 MiB system region "io" and a
// channel with the default options at its start.
struct ChannelSetup {
  std::vector<int32_t> pages;
  std::unique_ptr<KvMirror> mirror;
  std::unique_ptr<SharedMemory> shm;
  std::unique_ptr<RequestChannel> channel;
};
void SetUpChannel(Client& client, const WorkloadSpec& spec, const std::string& shm_name,
                  std::mt19937_64& gen, ChannelSetup* out) {
  const KvGeometry g = GeometryOf(client.info());
  out->mirror = std::make_unique<KvMirror>(g);
  auto pages = client.AllocatePages(static_cast<int32_t>(PagesNeeded(g, spec)));
  ASSERT_TRUE(pages.ok()) << pages.status();
  out->pages = *std::move(pages);
  server_test::FillPages(client, *out->mirror, gen, 0, out->pages);
  out->shm = MakeShm(shm_name, 8 << 20);
  ASSERT_TRUE(out->shm && client.RegisterSystemRegion("io", *out->shm, 0, out->shm->size()).ok());
  ChannelOptions channel_options;
  auto channel = client.OpenChannel("io", out->shm->data(), 0,
                                    ChannelBytes(channel_options.slot_count, channel_options.slot_bytes),
                                    channel_options);
  ASSERT_TRUE(channel.ok()) << channel.status();
  out->channel = *std::move(channel);
}

TEST(ChannelRestartTest, ACallOnAChannelOfARestartedServerFailsAndTouchesNothing) {
  TestServerOptions options;
  options.extra_flags = {"--allow_shared_memory"};
  auto first = TestServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->grpc_address();
  auto a = ConnectTo(address, "", /*timeout_s=*/20);
  ASSERT_TRUE(a);
  const KvGeometry g = GeometryOf(a->info());
  std::mt19937_64 gen(11);
  WorkloadSpec spec;
  spec.batch = 2;
  spec.max_q_len = 3;
  spec.max_kv_len = 40;
  ChannelSetup set;
  SetUpChannel(*a, spec, "restart", gen, &set);
  if (HasFatalFailure()) return;
  RequestChannel* channel = set.channel.get();
  const std::vector<int32_t>& pages = set.pages;
  const PrefillInputs in = RandomPrefill(gen, g, spec, pages);
  auto before = channel->Prefill(ArgsOf(in));
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(kill((*first)->pid(), SIGKILL), 0);
  EXPECT_EQ((*first)->Wait(), 128 + SIGKILL);

  options.extra_flags.push_back(absl::StrCat("--listen=", address));
  auto second = TestServer::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  auto b = ConnectTo(address, "");
  ASSERT_TRUE(b);
  auto b_pages = b->AllocatePages(static_cast<int32_t>(pages.size()));
  ASSERT_TRUE(b_pages.ok());
  KvMirror b_mirror(g);
  server_test::FillPages(*b, b_mirror, gen, 0, *b_pages);
  const server_test::Snapshot b_before = server_test::Read(*b, g, *b_pages);

  // The append would write b's pages if anything read the old ring.
  const std::vector<int64_t> append_slots = {int64_t{pages[0]} * g.page_size};
  const auto ak = RandomHalves(gen, g.dtype, g.RowElems());
  PrefillArgs args = ArgsOf(in);
  args.append_slots = append_slots;
  args.append_k = ak;
  args.append_v = ak;
  absl::Status s = channel->Prefill(args).status();
  EXPECT_THAT(s.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("open a new channel"));
  EXPECT_TRUE(server_test::Read(*b, g, *b_pages) == b_before);
  // The channel's slot stays abandoned; Close answers from the new server.
  EXPECT_EQ(channel->Close().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*second)->Stop(), 0);
}

// A channel whose every slot was given up on (the caller's deadline passed)
// while the server still works on them: the next call waits for a slot
// while the server answers probes, instead of failing at once with
// UNAVAILABLE and "open a new channel" (as it did, for a channel that
// worked); once the answer has come, the channel serves again.
TEST(ChannelAbandonedTest, SlotsGivenUpOnAreWaitedForWhileTheServerAnswers) {
  TestServerOptions options;
  options.num_pages = 256;
  options.extra_flags = {"--allow_shared_memory", "--check_kv_written=false"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  // The channel's calls have the client's deadline: 0.5 s.
  auto client = ConnectTo((*server)->grpc_address(), "", /*timeout_s=*/0.5);
  ASSERT_TRUE(client);
  const KvGeometry g = GeometryOf(client->info());
  auto pages = client->AllocatePages(256);
  ASSERT_TRUE(pages.ok()) << pages.status();
  ChannelOptions opt;
  opt.slot_count = 1;
  opt.slot_bytes = 16 << 20;
  const int64_t ring = ChannelBytes(opt.slot_count, opt.slot_bytes);
  auto shm = SharedMemory::Create("abandoned", ring);
  ASSERT_TRUE(shm.ok()) << shm.status();
  ASSERT_TRUE(client->RegisterSystemRegion("abandoned", **shm, 0, ring).ok());
  auto channel = client->OpenChannel("abandoned", (*shm)->data(), 0, ring, opt);
  ASSERT_TRUE(channel.ok()) << channel.status();
  // Seconds of the CPU server's work: 8,192 rows over 4,096 keys.
  const int64_t row = int64_t{g.num_qo_heads} * g.head_dim;
  std::vector<uint16_t> q_big(8192 * row, 0x3f80), q_small(row, 0x3f80);
  const std::vector<int32_t> qo_big = {0, 8192}, kv_big = {0, 256}, last = {16};
  const std::vector<int32_t> qo_small = {0, 1}, kv_small = {0, 1}, one_page = {(*pages)[0]};
  PrefillArgs big;
  big.q = q_big;
  big.qo_indptr = qo_big;
  big.kv_indptr = kv_big;
  big.kv_indices = *pages;
  big.kv_last_page_len = last;
  big.causal = false;
  PrefillArgs small;
  small.q = q_small;
  small.qo_indptr = qo_small;
  small.kv_indptr = kv_small;
  small.kv_indices = one_page;
  small.kv_last_page_len = last;
  EXPECT_EQ((*channel)->Prefill(big).status().code(), absl::StatusCode::kDeadlineExceeded);
  const absl::Status waited = (*channel)->Prefill(small).status();
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
  absl::Status later = waited;  // once the big one is answered, the slot is free
  // (Up to 10 minutes: a sanitizer build on a loaded host runs the big one
  // for minutes; normally it ends within seconds.)
  for (int i = 0; i < 1200 && later.code() == absl::StatusCode::kDeadlineExceeded; ++i) {
    later = (*channel)->Prefill(small).status();
  }
  EXPECT_TRUE(later.ok()) << later;
  channel->reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

// SIGTERM with a channel request in flight: the request completes with the
// right result, the server drains and exits 0, and the channel's next call
// fails (never hangs), saying to open a new channel.
TEST(ChannelDrainTest, ARequestInFlightAtSigtermCompletesAndTheServerExits) {
  TestServerOptions options;
  options.extra_flags = {"--allow_shared_memory", "--drain_timeout_s=20"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto a = ConnectTo((*server)->grpc_address(), "", /*timeout_s=*/20);
  ASSERT_TRUE(a);
  const KvGeometry g = GeometryOf(a->info());
  std::mt19937_64 gen(13);
  WorkloadSpec spec;
  spec.batch = 2;
  spec.max_q_len = 256;
  spec.max_kv_len = 2048;
  ChannelSetup set;
  SetUpChannel(*a, spec, "drain", gen, &set);
  if (HasFatalFailure()) return;
  RequestChannel* channel = set.channel.get();
  const std::vector<int32_t>& pages = set.pages;
  const KvMirror& mirror = *set.mirror;
  const PrefillInputs in = RandomPrefill(gen, g, spec, pages);
  // SIGTERM once the server has parsed the request: past its draining check
  // (the in-flight gauge rises before that check, so a signal sent on it
  // alone may find the request still to be turned away, as a slow build did).
  const std::string parsed = "attnserve_request_stage_seconds_count";
  const std::string stage = "stage=\"parse\"";
  const double before = Metric(**server, parsed, stage);
  absl::StatusOr<PrefillResult> got = absl::UnknownError("not called");
  std::thread caller([&] { got = channel->Prefill(ArgsOf(in)); });
  EXPECT_GE(AwaitMetric(**server, parsed, stage, before + 1), before + 1);
  ASSERT_EQ(kill((*server)->pid(), SIGTERM), 0);
  caller.join();
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatchesReference(mirror, in, *got);
  EXPECT_EQ((*server)->Wait(), 0) << (*server)->Output();
  WorkloadSpec small = spec;
  small.max_q_len = 2;
  absl::Status after = channel->Prefill(ArgsOf(RandomPrefill(gen, g, small, pages))).status();
  EXPECT_THAT(after.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << after;
  EXPECT_THAT(std::string(after.message()), HasSubstr("open a new channel"));
}

}  // namespace
}  // namespace attnserve
