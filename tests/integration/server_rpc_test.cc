// Every RPC of the real server once, through the C++ client: server info,
// health, pages, WriteKV/ReadKV, and the incarnation of each start.
#include "tests/integration/server_fixture.h"

namespace attnserve {
namespace server_test {
namespace {

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
  // A freed page is nobody's: freeing it again is refused, saying it is not
  // allocated (not that it belongs to someone else).
  const absl::Status again = client_->FreePages({(*b)[0]});
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr("is not allocated"));
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

}  // namespace
}  // namespace server_test
}  // namespace attnserve
