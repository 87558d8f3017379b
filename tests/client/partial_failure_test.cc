// The partial failures of issue #29, one at a time, against real attnserve
// binaries (CPU backend): a KvManager::Finish() whose FreePages reply is
// lost after the server freed the pages; a Cluster::Finish() of sequences
// on two servers while one of them cannot be reached; a cluster server that
// never comes back. Each checks, against the float64 reference over the K/V
// the test wrote, that no later call attends over another sequence's KV,
// and that the named sequences are gone.
#include <stdlib.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/channel.h"
#include "client/client.h"
#include "client/cluster.h"
#include "client/kv_manager.h"
#include "client/shared_memory.h"
#include "client/workload.h"
#include "common/channel_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fault_injection.h"
#include "tests/client/sequence_model.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

TestServerOptions SmallServer() {
  setenv("OMP_NUM_THREADS", "1", 1);
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  TestServerOptions o;
  o.num_layers = 2;
  o.num_pages = 64;
  o.page_size = 4;
  o.num_qo_heads = 2;
  o.num_kv_heads = 1;
  o.head_dim = 64;
  return o;
}

// Random q, k, v of one layer of a step of n rows.
struct LayerData {
  std::vector<uint16_t> q, k, v;
};
LayerData RandomLayer(std::mt19937_64& gen, const KvGeometry& g, int64_t n) {
  return {RandomHalves(gen, g.dtype, n * g.num_qo_heads * g.head_dim),
          RandomHalves(gen, g.dtype, n * g.RowElems()),
          RandomHalves(gen, g.dtype, n * g.RowElems())};
}

// Runs every layer of a one-sequence step (`run` returns its output),
// writes its rows into the model and returns the mismatches found.
template <typename RunFn>
std::vector<std::string> RunChecked(RunFn run, SequenceModel& model, const KvGeometry& g,
                                    std::mt19937_64& gen, int64_t seq, int32_t q_len,
                                    int64_t kv_len) {
  std::vector<std::string> wrong;
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    LayerData d = RandomLayer(gen, g, q_len);
    absl::StatusOr<PrefillResult> out = run(layer, d);
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return wrong;
    model.Write(seq, layer, kv_len - q_len, d.k, d.v);
    const SequenceModel::Part part{seq, 0, q_len, kv_len};
    for (const auto& [id, why] : model.Check(layer, {part}, d.q, out->o, out->lse)) {
      wrong.push_back(absl::StrCat("sequence ", id, " layer ", layer, ": ", why));
    }
  }
  return wrong;
}

std::unique_ptr<Client> ConnectWith(const std::string& target,
                                    const std::shared_ptr<FaultInjector>& faults) {
  ClientOptions o;
  o.target = target;
  o.timeout_s = 30;
  if (faults != nullptr) o.interceptors = faults->Interceptors();
  auto c = Client::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// A RequestChannel::Close() whose CloseChannel failed with its outcome
// unknown is sent again by the next Close(): one that never left keeps the
// channel open on the server until then; one whose reply was lost closed it,
// and the second send's NOT_FOUND is OK. Before, the second Close() returned
// OK without a word to the server, which kept the channel (and one of the
// tenant's --max_channels_per_tenant) until its region went.
TEST(ChannelPartialFailureTest, ACloseWhoseOutcomeIsUnknownIsSentAgain) {
  TestServerOptions options = SmallServer();
  options.extra_flags = {"--allow_shared_memory"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto faults = std::make_shared<FaultInjector>(1);
  auto client = ConnectWith((*server)->grpc_address(), faults);
  auto admin = ConnectWith((*server)->grpc_address(), nullptr);
  ASSERT_NE(client, nullptr);
  ASSERT_NE(admin, nullptr);
  const int64_t bytes = ChannelBytes(2, 64 << 10);
  auto shm = SharedMemory::Create(absl::StrCat("attn_pf_", getpid()), 2 * bytes);
  ASSERT_TRUE(shm.ok()) << shm.status();
  ASSERT_TRUE(client->RegisterSystemRegion("io", **shm, 0, 2 * bytes).ok());
  auto open_channels = [&]() {
    auto held = admin->ListHoldings();
    EXPECT_TRUE(held.ok()) << held.status();
    return held.ok() ? held->unleased().channel_ids_size() : -1;
  };
  ChannelOptions co;
  co.slot_count = 2;
  co.slot_bytes = 64 << 10;
  for (const Fault fault : {Fault::kUnreachable, Fault::kReplyLost}) {
    SCOPED_TRACE(fault == Fault::kUnreachable ? "unreachable" : "reply lost");
    auto channel = client->OpenChannel("io", (*shm)->data(), fault == Fault::kUnreachable ? 0 : bytes,
                                       bytes, co);
    ASSERT_TRUE(channel.ok()) << channel.status();
    ASSERT_EQ(open_channels(), 1);
    faults->FailNext("CloseChannel", fault);
    const absl::Status first = (*channel)->Close();
    EXPECT_TRUE(OutcomeUnknown(first)) << first;
    EXPECT_EQ(open_channels(), fault == Fault::kUnreachable ? 1 : 0);
    EXPECT_TRUE((*channel)->Close().ok());
    EXPECT_EQ(open_channels(), 0);
    EXPECT_TRUE((*channel)->Close().ok());  // answered: nothing more is sent
  }
}

// Issue #29, item 1: FreePages times out on the client while the server
// completes it. The old manager kept the sequence and its pages; the next
// sequence was given those pages, and the old one then attended over the new
// one's KV without an error.
TEST(KvManagerPartialFailureTest, AFinishWhoseReplyIsLostNeverLeavesASequenceOverFreedPages) {
  auto server = TestServer::Start(SmallServer());
  ASSERT_TRUE(server.ok()) << server.status();
  auto faults = std::make_shared<FaultInjector>(1);
  auto client = ConnectWith((*server)->grpc_address(), faults);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  SequenceModel model(g);
  std::mt19937_64 gen(291);
  KvManager mgr(client.get());
  auto run = [&](int32_t layer, const LayerData& d) { return mgr.Run(layer, d.q, d.k, d.v); };

  ASSERT_TRUE(mgr.Plan({1}, {8}).ok());  // two pages
  EXPECT_THAT(RunChecked(run, model, g, gen, 1, 8, 8), ::testing::IsEmpty());

  faults->FailNext("FreePages", Fault::kReplyLost);  // the server frees them; the reply is lost
  EXPECT_FALSE(mgr.Finish({1}).ok());
  EXPECT_EQ(mgr.KvLen(1), -1) << "sequence 1 outlived a Finish() whose outcome is unknown";

  // The next sequence gets the pages the server freed.
  ASSERT_TRUE(mgr.Plan({2}, {8}).ok());
  EXPECT_THAT(RunChecked(run, model, g, gen, 2, 8, 8), ::testing::IsEmpty());
  if (mgr.KvLen(1) >= 0) {  // decoding sequence 1 must not attend over sequence 2's KV
    ASSERT_TRUE(mgr.Plan({1}, {1}).ok());
    EXPECT_THAT(RunChecked(run, model, g, gen, 1, 1, 9), ::testing::IsEmpty());
  }
  EXPECT_TRUE(mgr.Release().ok());
}

// A manager that abandoned its lease (its server seemed unreachable; the
// server, alive, keeps the lease and its pages) and then finds its next
// lease gone forgets that one (Reset(false), as the cluster does), but still
// revokes the first: Release() leaves nothing held. Before, that Reset()
// dropped the leases left to revoke, and their pages stayed held until their
// ttl.
TEST(KvManagerPartialFailureTest, ALostLeaseKeepsTheEarlierLeasesToRevoke) {
  auto server = TestServer::Start(SmallServer());
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = ConnectWith((*server)->grpc_address(), nullptr);
  auto admin = ConnectWith((*server)->grpc_address(), nullptr);
  ASSERT_NE(client, nullptr);
  ASSERT_NE(admin, nullptr);
  KvManager mgr(client.get());
  ASSERT_TRUE(mgr.Plan({1}, {8}).ok());
  const uint64_t first = mgr.lease_id();
  ASSERT_NE(first, 0u);
  mgr.Abandon();
  auto held = admin->ListHoldings(0);
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_EQ(held->leases_size(), 1);
  EXPECT_EQ(held->leases(0).lease_id(), first);
  mgr.Reset(/*restarted=*/false);
  EXPECT_TRUE(mgr.Release().ok());
  held = admin->ListHoldings(0);
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(held->leases_size(), 0) << "the abandoned lease was never revoked";
  EXPECT_EQ(held->unleased().page_ids_size(), 0);
}

// Issue #29, item 2: Finish(a, b) while b's server is briefly unreachable.
// The old cluster had a's server free and forget `a` but kept listing it,
// and decoding `a` attended over a fresh one-token sequence.
TEST(ClusterPartialFailureTest, AFinishThatFailsOnOneServerForgetsEverySequenceItNames) {
  std::vector<std::unique_ptr<TestServer>> servers;
  auto faults = std::make_shared<FaultInjector>(2);
  ClusterOptions options;
  for (int i = 0; i < 2; ++i) {
    auto s = TestServer::Start(SmallServer());
    ASSERT_TRUE(s.ok()) << s.status();
    options.targets.push_back((*s)->grpc_address());
    servers.push_back(*std::move(s));
  }
  options.client.timeout_s = 30;
  options.client.interceptors = faults->Interceptors();
  auto cluster = Cluster::Connect(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  const KvGeometry g = c.geometry();
  SequenceModel model(g);
  std::mt19937_64 gen(292);
  auto run = [&](int32_t layer, const LayerData& d) { return c.Run(layer, d.q, d.k, d.v); };

  const int64_t a = 10, b = 20;
  ASSERT_TRUE(c.Plan({a}, {8}).ok());
  EXPECT_THAT(RunChecked(run, model, g, gen, a, 8, 8), ::testing::IsEmpty());
  ASSERT_TRUE(c.Plan({b}, {8}).ok());  // the other server: it has more free pages
  EXPECT_THAT(RunChecked(run, model, g, gen, b, 8, 8), ::testing::IsEmpty());
  ASSERT_EQ(c.ShardsOf(a).size(), 1u);
  ASSERT_EQ(c.ShardsOf(b).size(), 1u);
  ASSERT_NE(c.ShardsOf(a)[0].server, c.ShardsOf(b)[0].server);

  const std::string b_server = options.targets[c.ShardsOf(b)[0].server];
  faults->SetDown(b_server, true);
  absl::Status finished = c.Finish({a, b});
  faults->SetDown(b_server, false);
  EXPECT_FALSE(finished.ok());
  EXPECT_THAT(finished.message(), ::testing::HasSubstr(b_server));
  EXPECT_EQ(c.KvLen(a), -1) << "sequence a outlived a Finish() that freed it: " << finished;
  EXPECT_EQ(c.KvLen(b), -1) << finished;

  if (c.KvLen(a) >= 0) {  // decoding `a` must not attend over anything but a's KV
    ASSERT_TRUE(c.Plan({a}, {1}).ok());
    EXPECT_THAT(RunChecked(run, model, g, gen, a, 1, 9), ::testing::IsEmpty());
  }
  EXPECT_TRUE(c.Release().ok());
  EXPECT_TRUE(c.Sequences().empty());
}

// A Plan() that fails on the second server planned takes back the first,
// whose manager's earlier plans of those sequences went stale with the new
// ones: the cluster's previous step is stale too (before, it stayed live and
// its run failed part-way on that server), and the step planned again runs.
TEST(ClusterPartialFailureTest, APlanThatFailsOnOneServerRetiresTheStepBefore) {
  std::vector<std::unique_ptr<TestServer>> servers;
  auto faults = std::make_shared<FaultInjector>(3);
  ClusterOptions options;
  for (int i = 0; i < 2; ++i) {
    auto s = TestServer::Start(SmallServer());
    ASSERT_TRUE(s.ok()) << s.status();
    options.targets.push_back((*s)->grpc_address());
    servers.push_back(*std::move(s));
  }
  options.client.timeout_s = 30;
  options.client.interceptors = faults->Interceptors();
  auto cluster = Cluster::Connect(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  const KvGeometry g = c.geometry();
  std::mt19937_64 gen(293);
  auto planned = c.Plan({1, 2}, {4, 4});
  ASSERT_TRUE(planned.ok()) << planned.status();
  ASSERT_NE(c.ShardsOf(1)[0].server, c.ShardsOf(2)[0].server);
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    LayerData d = RandomLayer(gen, g, 8);
    ASSERT_TRUE(c.Run(layer, d.q, d.k, d.v).ok());
  }
  // The second server of the next step cannot be reached for its pages.
  faults->FailNext("AllocatePages", Fault::kUnreachable, options.targets[c.ShardsOf(2)[0].server]);
  EXPECT_FALSE(c.Plan({1, 2}, {1, 1}).ok());
  LayerData d = RandomLayer(gen, g, 8);
  auto prefills = [&] {
    auto calls = faults->calls();
    auto it = calls.find("Prefill");
    return it == calls.end() ? int64_t{0} : it->second;
  };
  const int64_t before = prefills();
  absl::StatusOr<PrefillResult> stale = c.Run(0, d.q, d.k, d.v, planned->get());
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_THAT(stale.status().message(), ::testing::HasSubstr("is stale"));
  EXPECT_EQ(prefills(), before) << "a stale step sent a Prefill: " << stale.status();
  auto again = c.Plan({1, 2}, {1, 1});
  ASSERT_TRUE(again.ok()) << again.status();
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    LayerData one = RandomLayer(gen, g, 2);
    EXPECT_TRUE(c.Run(layer, one.q, one.k, one.v).ok());
  }
  EXPECT_TRUE(c.Release().ok());
}

// Issue #29, item 3: a server of a fixed target list that never comes back.
// The old cluster never declared its sequences lost, and Finish() and
// Release() failed with UNAVAILABLE for ever.
TEST(ClusterPartialFailureTest, AServerThatNeverComesBackDoesNotBlockFinishOrRelease) {
  std::vector<std::unique_ptr<TestServer>> servers;
  ClusterOptions options;
  for (int i = 0; i < 2; ++i) {
    auto s = TestServer::Start(SmallServer());
    ASSERT_TRUE(s.ok()) << s.status();
    options.targets.push_back((*s)->grpc_address());
    servers.push_back(*std::move(s));
  }
  options.client.timeout_s = 30;
  auto cluster = Cluster::Connect(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  Cluster& c = **cluster;
  ASSERT_TRUE(c.Plan({1, 2, 3, 4}, {8, 8, 8, 8}).ok());
  std::vector<int64_t> on_dead;
  for (int64_t id : {1, 2, 3, 4}) {
    if (c.ShardsOf(id)[0].server == 1) on_dead.push_back(id);
  }
  ASSERT_EQ(on_dead.size(), 2u);
  EXPECT_EQ(servers[1]->Stop(), 0);  // for good

  // Finish() forgets what it names whatever happens, and Release() too.
  c.Finish({on_dead[0]}).IgnoreError();
  EXPECT_EQ(c.KvLen(on_dead[0]), -1);
  absl::Status released = c.Release();
  if (!released.ok()) released = c.Release();  // the first may report the dead server
  EXPECT_TRUE(released.ok()) << released;
  EXPECT_TRUE(c.Sequences().empty());
  EXPECT_TRUE(c.Lost().empty());
}

}  // namespace
}  // namespace attnserve
