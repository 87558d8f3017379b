// --check_kv_written (docs/design.md section 4, "Rows written"): a Prefill
// that would read KV rows nobody wrote since their page was allocated is
// refused with FAILED_PRECONDITION naming the sequence, the page and the rows,
// whether it sends its layout or names a plan; rows written by WriteKV or by
// the request's own fused append count; a page freed and allocated again
// counts as unwritten; with --check_kv_written=false the old behaviour
// (unwritten rows read as zeros) stays.
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Client> Connect(const TestServer& server) {
  ClientOptions options;
  options.target = server.grpc_address();
  options.timeout_s = 60;
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// One sequence of `rows` query rows over `pages`, its last page holding
// `last` keys; q random.
struct OneSequence {
  std::vector<uint16_t> q;
  std::vector<int32_t> qo_indptr, kv_indptr, kv_indices, kv_last_page_len;

  OneSequence(const KvGeometry& g, const std::vector<int32_t>& pages, int32_t last, int32_t rows,
              std::mt19937_64& gen)
      : q(RandomHalves(gen, g.dtype, int64_t{rows} * g.num_qo_heads * g.head_dim)),
        qo_indptr{0, rows},
        kv_indptr{0, static_cast<int32_t>(pages.size())},
        kv_indices(pages),
        kv_last_page_len{last} {}

  PrefillArgs Args(int32_t layer) const {
    PrefillArgs a;
    a.layer = layer;
    a.q = q;
    a.qo_indptr = qo_indptr;
    a.kv_indptr = kv_indptr;
    a.kv_indices = kv_indices;
    a.kv_last_page_len = kv_last_page_len;
    return a;
  }
};

TEST(KvWrittenTest, APrefillOverUnwrittenRowsIsRefusedNamingThem) {
  auto server = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  std::mt19937_64 gen(7);
  auto pages = client->AllocatePages(2);
  ASSERT_TRUE(pages.ok()) << pages.status();
  const OneSequence seq(g, *pages, /*last=*/5, /*rows=*/3, gen);

  // Nothing written: refused, nothing computed over zeros.
  auto out = client->Prefill(seq.Args(0));
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition) << out.status();
  EXPECT_THAT(out.status().message(),
              HasSubstr(absl::StrCat("sequence 0 reads rows [0, 16) of page ", (*pages)[0],
                                     " (kv_indices[0]) in layer 0, but row 0 was never written "
                                     "there")));

  // The first page and 4 rows of the second in layer 0: one row short.
  std::vector<int64_t> slots = SlotsOfPages(g, *pages);
  slots.resize(g.page_size + 4);
  auto k = RandomHalves(gen, g.dtype, static_cast<int64_t>(slots.size()) * g.RowElems());
  ASSERT_TRUE(client->WriteKV(0, slots, k, k).ok());
  out = client->Prefill(seq.Args(0));
  EXPECT_THAT(out.status().message(),
              HasSubstr(absl::StrCat("reads rows [0, 5) of page ", (*pages)[1],
                                     " (kv_indices[1]) in layer 0, but row 4 was never written")));
  // The fifth row appended by the request itself.
  OneSequence appending = seq;
  PrefillArgs args = appending.Args(0);
  const std::vector<int64_t> append = {int64_t{(*pages)[1]} * g.page_size + 4};
  const auto row = RandomHalves(gen, g.dtype, g.RowElems());
  args.append_slots = append;
  args.append_k = row;
  args.append_v = row;
  out = client->Prefill(args);
  EXPECT_TRUE(out.ok()) << out.status();
  // Now written: the same read without the append passes; layer 1 has nothing.
  EXPECT_TRUE(client->Prefill(seq.Args(0)).ok());
  // Sequences without query rows read nothing: one over an unwritten layer is
  // not checked, and the error for the one after it names it as the request
  // numbers it (sequence 2, after an empty sequence 1 the task leaves out).
  {
    PrefillArgs a = seq.Args(1);
    const std::vector<int32_t> qo = {0, 3, 3, 6}, kvp = {0, 0, 2, 4}, idx = {(*pages)[0], (*pages)[1],
                                                                           (*pages)[0], (*pages)[1]};
    const std::vector<int32_t> lens = {0, 5, 5};
    const auto q = RandomHalves(gen, g.dtype, int64_t{6} * g.num_qo_heads * g.head_dim);
    a.q = q;
    a.qo_indptr = qo;
    a.kv_indptr = kvp;
    a.kv_indices = idx;
    a.kv_last_page_len = lens;
    auto refused = client->Prefill(a);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
    EXPECT_THAT(refused.status().message(), HasSubstr("sequence 2 reads rows [0, 16) of page "));
    a.layer = 0;
    EXPECT_TRUE(client->Prefill(a).ok());
  }
  EXPECT_EQ(client->Prefill(seq.Args(1)).status().code(), absl::StatusCode::kFailedPrecondition);

  // Freed and allocated again, the pages hold nothing of the old owner's.
  ASSERT_TRUE(client->FreePages(*pages).ok());
  auto again = client->AllocatePages(static_cast<int32_t>(g.num_pages));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(client->Prefill(seq.Args(0)).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(client->FreePages(*again).ok());
}

TEST(KvWrittenTest, APlanIsCheckedPerLayerAtEachPrefill) {
  auto server = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  std::mt19937_64 gen(8);
  auto pages = client->AllocatePages(1);
  ASSERT_TRUE(pages.ok());
  // A decode step: 3 keys, the third appended by each layer's Prefill.
  std::vector<int64_t> first = {int64_t{(*pages)[0]} * g.page_size,
                                int64_t{(*pages)[0]} * g.page_size + 1};
  auto kv = RandomHalves(gen, g.dtype, 2 * g.RowElems());
  ASSERT_TRUE(client->WriteKV(0, first, kv, kv).ok());
  const std::vector<int32_t> qo = {0, 1}, kvp = {0, 1}, last = {3};
  const std::vector<int64_t> append = {first[1] + 1};
  PlanLayout layout;
  layout.qo_indptr = qo;
  layout.kv_indptr = kvp;
  layout.kv_indices = *pages;
  layout.kv_last_page_len = last;
  layout.append_slots = append;
  auto plan = client->CreatePlan(layout);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto q = RandomHalves(gen, g.dtype, int64_t{g.num_qo_heads} * g.head_dim);
  const auto row = RandomHalves(gen, g.dtype, g.RowElems());
  PrefillArgs args;
  args.plan_id = *plan;
  args.q = q;
  args.append_k = row;
  args.append_v = row;
  args.layer = 0;
  EXPECT_TRUE(client->Prefill(args).ok());
  args.layer = 1;  // layer 1 never got the first two keys, only the appended third
  auto out = client->Prefill(args);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition) << out.status();
  EXPECT_THAT(out.status().message(), HasSubstr("in layer 1, but row 0 was never written"));
  ASSERT_TRUE(client->ReleasePlan(*plan).ok());
}

TEST(KvWrittenTest, AnotherTenantsPageIsDeniedWithoutSayingWhatItHolds) {
  auto tokens = WriteTokensFile("tok-a alice\ntok-b bob\n");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  TestServerOptions options;
  options.extra_flags = {absl::StrCat("--auth_tokens_file=", *tokens)};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions a, b;
  a.target = b.target = (*server)->grpc_address();
  a.token = "tok-a";
  b.token = "tok-b";
  auto alice = Client::Connect(a), bob = Client::Connect(b);
  ASSERT_TRUE(alice.ok() && bob.ok());
  const KvGeometry g = GeometryOf((*alice)->info());
  std::mt19937_64 gen(10);
  auto pages = (*alice)->AllocatePages(2);  // one written, one not
  ASSERT_TRUE(pages.ok());
  const std::vector<int64_t> slots = SlotsOfPages(g, {(*pages)[0]});
  const auto k = RandomHalves(gen, g.dtype, static_cast<int64_t>(slots.size()) * g.RowElems());
  ASSERT_TRUE((*alice)->WriteKV(0, slots, k, k).ok());
  for (int32_t page : *pages) {
    const OneSequence seq(g, {page}, /*last=*/16, /*rows=*/1, gen);
    const absl::Status s = (*bob)->Prefill(seq.Args(0)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
    EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("written")));
  }
}

TEST(KvWrittenTest, OffTheUnwrittenRowsReadAsZeros) {
  TestServerOptions options;
  options.extra_flags = {"--check_kv_written=false"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_THAT((*server)->Output(), HasSubstr("check_kv_written=off"));
  auto client = Connect(**server);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  std::mt19937_64 gen(9);
  auto pages = client->AllocatePages(1);
  ASSERT_TRUE(pages.ok());
  const OneSequence seq(g, *pages, /*last=*/16, /*rows=*/2, gen);
  auto out = client->Prefill(seq.Args(0));
  ASSERT_TRUE(out.ok()) << out.status();
  // Attention over zero keys and values: the output is zero.
  for (uint16_t x : out->o) EXPECT_EQ(x & 0x7fff, 0);
}

}  // namespace
}  // namespace attnserve
