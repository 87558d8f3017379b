// Tenants on one server: freed pages zeroed before another tenant gets them,
// health without a token, and attnctl against an authenticated server.
#include "tests/integration/server_fixture.h"

#ifndef ATTNCTL_BIN
#error "ATTNCTL_BIN must name the attnctl binary"
#endif

namespace attnserve {
namespace server_test {
namespace {

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
}  // namespace server_test
}  // namespace attnserve
