// Restart safety (docs/security.md, "Across restarts"): a client that outlived
// a server restart cannot change or read the pages that the new server gave
// to someone else, and a second server cannot share a port with the first.
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/shared_memory.h"
#include "client/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Client> Connect(const std::string& target) {
  ClientOptions options;
  options.target = target;
  options.timeout_s = 60;
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// After a restart, RegisterSystemRegion is refused (a stale incarnation)
// until the client forgets the old incarnation; then it registers on the
// new server (before, the deposit kept naming the incarnation read at
// connect, and was refused for good).
TEST(RestartSafetyTest, ARegionRegistersOnARestartedServerOnceTheIncarnationIsForgotten) {
  TestServerOptions options;
  options.extra_flags = {"--allow_shared_memory"};
  auto first = TestServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->grpc_address();
  auto a = Connect(address);
  ASSERT_TRUE(a);
  auto shm = SharedMemory::Create("io", 4096);
  ASSERT_TRUE(shm.ok()) << shm.status();
  ASSERT_TRUE(a->RegisterSystemRegion("io", **shm, 0, 4096).ok());
  auto second = TestServer::RestartOn(**first, options);
  ASSERT_TRUE(second.ok()) << second.status();
  const absl::Status stale = a->RegisterSystemRegion("io", **shm, 0, 4096);
  EXPECT_TRUE(IsStaleIncarnation(stale)) << stale;
  a->ForgetIncarnation();
  const absl::Status again = a->RegisterSystemRegion("io", **shm, 0, 4096);
  EXPECT_TRUE(again.ok()) << again;
  EXPECT_NE(a->incarnation(), 0u);
  EXPECT_EQ((*second)->Stop(), 0);
}

TEST(RestartSafetyTest, AStaleClientCannotTouchPagesANewClientOwns) {
  TestServerOptions options;
  auto first = TestServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->grpc_address();
  auto a = Connect(address);
  ASSERT_TRUE(a);
  const KvGeometry g = GeometryOf(a->info());
  auto a_pages = a->AllocatePages(2);
  ASSERT_TRUE(a_pages.ok()) << a_pages.status();
  EXPECT_EQ(a->incarnation(), a->info().incarnation());

  // A new server on the same port: auth is off, so A and B are one tenant.
  auto second = TestServer::RestartOn(**first, options);
  ASSERT_TRUE(second.ok()) << second.status();
  auto b = Connect(address);
  ASSERT_TRUE(b);
  ASSERT_NE(b->incarnation(), a->incarnation());
  auto b_pages = b->AllocatePages(2);
  ASSERT_TRUE(b_pages.ok()) << b_pages.status();
  ASSERT_EQ(*b_pages, *a_pages) << "the new server hands out the same page ids";
  std::mt19937_64 gen(7);
  const std::vector<int64_t> slots = SlotsOfPages(g, *b_pages);
  const int64_t elems = static_cast<int64_t>(slots.size()) * g.RowElems();
  const std::vector<uint16_t> k = RandomHalves(gen, g.dtype, elems);
  const std::vector<uint16_t> v = RandomHalves(gen, g.dtype, elems);
  ASSERT_TRUE(b->WriteKV(0, slots, k, v).ok());
  const int32_t free_before = b->GetServerInfo()->free_pages();

  // Every request of A that names pages or slots is refused, and says why.
  const std::vector<uint16_t> garbage = RandomHalves(gen, g.dtype, elems);
  std::vector<absl::Status> refused = {
      RetryWhileUnavailable([&] { return a->WriteKV(0, slots, garbage, garbage); }),
      a->ReadKV(0, slots).status(),
      a->FreePages(*a_pages),
      a->AllocatePages(1).status(),
  };
  PrefillArgs args;
  const std::vector<uint16_t> q = RandomHalves(gen, g.dtype, int64_t{g.num_qo_heads} * g.head_dim);
  const std::vector<int32_t> qo_indptr = {0, 1}, kv_indptr = {0, 1}, last = {1};
  const std::vector<int32_t> indices = {(*a_pages)[0]};
  args.q = q;
  args.qo_indptr = qo_indptr;
  args.kv_indptr = kv_indptr;
  args.kv_indices = indices;
  args.kv_last_page_len = last;
  refused.push_back(a->Prefill(args).status());
  for (const absl::Status& s : refused) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("expected_incarnation"));
  }

  // B's pages and KV are untouched.
  auto read = b->ReadKV(0, slots);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->k, k);
  EXPECT_EQ(read->v, v);
  EXPECT_EQ(b->GetServerInfo()->free_pages(), free_before);

  // Once A forgets the old server, it is an ordinary client of the new one.
  a->ForgetIncarnation();
  auto fresh = a->AllocatePages(1);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(a->incarnation(), b->incarnation());
  EXPECT_TRUE(a->FreePages(*fresh).ok());
}

// A server back on the port with another geometry is not one this client
// can lay out requests for (slots and page counts follow the page size it
// connected to): GetServerInfo says so, naming what changed, and adopts
// nothing; the same geometry is adopted as before.
TEST(RestartSafetyTest, AServerBackWithAnotherGeometryIsRefusedByGetServerInfo) {
  TestServerOptions options;
  auto first = TestServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->grpc_address();
  auto a = Connect(address);
  ASSERT_TRUE(a);
  const uint64_t known = a->incarnation();
  options.page_size = 8;
  options.num_pages = 64;  // (num_pages may differ: it is no part of the check)
  auto second = TestServer::RestartOn(**first, options);
  ASSERT_TRUE(second.ok()) << second.status();
  a->ForgetIncarnation();
  absl::StatusOr<v1::ServerInfo> info = RetryWhileUnavailable([&] { return a->GetServerInfo(); });
  EXPECT_EQ(info.status().code(), absl::StatusCode::kFailedPrecondition) << info.status();
  EXPECT_THAT(std::string(info.status().message()),
              HasSubstr(absl::StrCat(address, " restarted with another geometry: page_size=8 (it had 16); ")));
  EXPECT_TRUE(IsAnotherGeometry(info.status()));
  EXPECT_EQ(a->incarnation(), 0u) << "adopted the other geometry's incarnation";
  EXPECT_EQ(a->info().page_size(), 16);
  // Calls that lay out pages or slots read the geometry first, and change
  // nothing on a server that has another.
  auto other = Connect(address);
  ASSERT_TRUE(other);
  const int32_t free_before = other->GetServerInfo()->free_pages();
  auto pages = a->AllocatePages(2);
  EXPECT_TRUE(IsAnotherGeometry(pages.status())) << pages.status();
  const std::vector<int64_t> slots = {0, 1};
  const std::vector<uint16_t> rows(2 * GeometryOf(a->info()).RowElems(), 0x3f80);
  EXPECT_TRUE(IsAnotherGeometry(a->WriteKV(0, slots, rows, rows)));
  EXPECT_TRUE(IsAnotherGeometry(a->ReadKV(0, slots).status()));
  EXPECT_EQ(other->GetServerInfo()->free_pages(), free_before);
  // A client connected without reading the info has no geometry to keep.
  ClientOptions lazy;
  lazy.target = address;
  lazy.fetch_info = false;
  auto unread = Client::Connect(lazy);
  ASSERT_TRUE(unread.ok()) << unread.status();
  EXPECT_TRUE((*unread)->GetServerInfo().ok());
  options.page_size = 16;
  auto third = TestServer::RestartOn(**second, options);
  ASSERT_TRUE(third.ok()) << third.status();
  info = RetryWhileUnavailable([&] { return a->GetServerInfo(); });
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_NE(a->incarnation(), known);
  EXPECT_EQ(a->incarnation(), info->incarnation());
}

TEST(RestartSafetyTest, EveryResponseCarriesTheIncarnation) {
  auto server = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  auto c = Connect((*server)->grpc_address());
  ASSERT_TRUE(c);
  const uint64_t incarnation = c->info().incarnation();
  ASSERT_NE(incarnation, 0u);
  const KvGeometry g = GeometryOf(c->info());
  v1::AllocatePagesRequest alloc;
  alloc.set_count(1);
  v1::AllocatePagesResponse allocated;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(c->stub()->AllocatePages(&ctx, alloc, &allocated).ok());
  }
  EXPECT_EQ(allocated.incarnation(), incarnation);
  const int64_t slot = int64_t{allocated.page_ids(0)} * g.page_size;
  std::mt19937_64 gen(3);
  const std::vector<uint16_t> row = RandomHalves(gen, g.dtype, g.RowElems());
  v1::WriteKVRequest write;
  write.add_slots(slot);
  for (v1::Tensor* t : {write.mutable_k(), write.mutable_v()}) {
    t->set_dtype(c->info().kv_dtype());
    for (int64_t d : {int64_t{1}, int64_t{g.num_kv_heads}, int64_t{g.head_dim}}) t->add_shape(d);
    t->set_data(row.data(), row.size() * sizeof(uint16_t));
  }
  v1::WriteKVResponse written;
  v1::ReadKVRequest read;
  read.add_slots(slot);
  v1::ReadKVResponse got;
  v1::MergeStatesRequest merge;
  v1::AttentionState* state = merge.add_states();
  state->mutable_v()->set_dtype(c->info().kv_dtype());
  for (int64_t d : {0, 1, 8}) state->mutable_v()->add_shape(d);
  state->mutable_lse()->set_dtype(v1::DTYPE_FP32);
  for (int64_t d : {0, 1}) state->mutable_lse()->add_shape(d);
  v1::MergeStatesResponse merged;
  v1::FreePagesRequest free;
  free.add_page_ids(allocated.page_ids(0));
  v1::FreePagesResponse freed;
  grpc::ClientContext c1, c2, c3, c4;
  ASSERT_TRUE(c->stub()->WriteKV(&c1, write, &written).ok());
  ASSERT_TRUE(c->stub()->ReadKV(&c2, read, &got).ok());
  ASSERT_TRUE(c->stub()->MergeStates(&c3, merge, &merged).ok());
  ASSERT_TRUE(c->stub()->FreePages(&c4, free, &freed).ok());
  EXPECT_EQ(written.incarnation(), incarnation);
  EXPECT_EQ(got.incarnation(), incarnation);
  EXPECT_EQ(merged.incarnation(), incarnation);
  EXPECT_EQ(freed.incarnation(), incarnation);
}

TEST(PortTest, ASecondServerOnTheSamePortExitsWithAClearError) {
  auto first = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(first.ok()) << first.status();
  TestServerOptions options;
  options.extra_flags = {absl::StrCat("--listen=", (*first)->grpc_address())};
  auto second = TestServer::Start(options);
  ASSERT_FALSE(second.ok()) << "a second server started on " << (*first)->grpc_address();
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr(absl::StrCat("--listen=", (*first)->grpc_address(),
                                     ": the address is already in use")));
  // The same for the metrics port.
  options.extra_flags = {absl::StrCat("--metrics_listen=", (*first)->metrics_address())};
  second = TestServer::Start(options);
  ASSERT_FALSE(second.ok()) << "a second server started on " << (*first)->metrics_address();
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr(absl::StrCat("--metrics_listen=", (*first)->metrics_address(),
                                     ": the address is already in use")));
  // The first still serves.
  auto c = Connect((*first)->grpc_address());
  ASSERT_TRUE(c);
  EXPECT_TRUE(c->Health().ok());
}

}  // namespace
}  // namespace attnserve
