// Load and churn: many concurrent clients of two tenants against the real
// server, mixing verified prefills, malformed requests, cross-tenant
// attempts, allocate/free churn, cancellations and short deadlines.
// Afterwards every valid result was right, every invalid request got its
// code, the free pages are back to their starting count, the server's
// resident memory stayed under a bound, and it still serves.
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/workload.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

constexpr int kThreads = 8;
constexpr int kIterations = 30;
constexpr int64_t kRssGrowthBoundKb = 256 * 1024;  // 256 MiB
const std::vector<int32_t> kOnePage = {0, 1};
const std::vector<int32_t> kLastLenOne = {1};


// Resident set of a process in KiB, from /proc.
int64_t RssKb(int pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      int64_t kb = 0;
      std::string digits;
      for (char c : line) {
        if (c >= '0' && c <= '9') digits += c;
      }
      if (absl::SimpleAtoi(digits, &kb)) return kb;
    }
  }
  return -1;
}

int PidFromOutput(const std::string& output) {
  auto at = output.find("pid=");
  if (at == std::string::npos) return -1;
  int pid = -1;
  absl::SimpleAtoi(output.substr(at + 4, output.find_first_not_of("0123456789", at + 4) - at - 4),
                   &pid);
  return pid;
}

struct Tally {
  std::atomic<int> verified{0}, rejected_as_expected{0}, deadline{0}, cancelled{0}, churned{0};
  std::atomic<int> wrong{0};  // any unexpected outcome
  std::mutex mu;
  std::vector<std::string> errors;
  void Wrong(const std::string& what) {
    ++wrong;
    std::lock_guard<std::mutex> lock(mu);
    if (errors.size() < 20) errors.push_back(what);
  }
};

class ChurnTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tokens = WriteTokensFile("churn-token-a alpha\nchurn-token-b beta\n");
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    tokens_path_ = *tokens;
    TestServerOptions options;
    options.num_pages = 512;
    options.page_size = 16;
    options.extra_flags = {"--auth_tokens_file=" + tokens_path_, "--tenant_max_pages=240",
                           "--max_batch_tokens=512"};
    auto server = TestServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override { std::remove(tokens_path_.c_str()); }

  std::unique_ptr<Client> Connect(const std::string& token, double timeout_s = 60) {
    ClientOptions o;
    o.target = server_->grpc_address();
    o.token = token;
    o.timeout_s = timeout_s;
    auto c = Client::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  std::string tokens_path_;
  std::unique_ptr<TestServer> server_;
};

// One client thread: `token` is its tenant; `other_page` is a page the other
// tenant holds for the whole test.
void ClientLoop(ChurnTest* test, Client& client, Client& short_deadline, const KvGeometry& g,
                int thread, int32_t other_page, Tally& tally) {
  std::mt19937_64 gen(1000 + thread);
  std::uniform_int_distribution<int> pick(0, 99);
  for (int it = 0; it < kIterations; ++it) {
    const int action = pick(gen);
    WorkloadSpec spec;
    spec.batch = 1 + it % 3;
    spec.max_q_len = 24;
    spec.max_kv_len = 96;
    spec.causal = (it % 4) != 0;
    spec.lse_base_e = (it % 5) == 0;
    spec.layer = it % g.num_layers;
    auto pages = client.AllocatePages(static_cast<int32_t>(PagesNeeded(g, spec)));
    if (!pages.ok()) {
      // Both tenants are capped well under the total: never out of pages here.
      tally.Wrong(absl::StrCat("AllocatePages: ", pages.status().ToString()));
      continue;
    }
    std::vector<int64_t> slots = SlotsOfPages(g, *pages);
    auto k = RandomHalves(gen, g.dtype, static_cast<int64_t>(slots.size()) * g.RowElems());
    auto v = RandomHalves(gen, g.dtype, static_cast<int64_t>(slots.size()) * g.RowElems());
    KvMirror mirror(g);
    if (absl::Status s = client.WriteKV(spec.layer, slots, k, v); !s.ok()) {
      tally.Wrong(absl::StrCat("WriteKV: ", s.ToString()));
    }
    mirror.Write(spec.layer, slots, k, v);
    PrefillInputs in = RandomPrefill(gen, g, spec, *pages);
    PrefillArgs args = ArgsOf(in);

    if (action < 45) {  // valid, verified
      auto out = client.Prefill(args);
      if (!out.ok()) {
        tally.Wrong(absl::StrCat("valid Prefill: ", out.status().ToString()));
      } else {
        std::vector<double> o_ref, lse_ref;
        ReferencePrefill(mirror, in, &o_ref, &lse_ref);
        Comparison c = Compare(g.dtype, o_ref, lse_ref, out->o, out->lse);
        if (c.Ok(g.dtype)) {
          ++tally.verified;
        } else {
          tally.Wrong("wrong result: " + c.ToString());
        }
      }
    } else if (action < 60) {  // malformed: each field in turn
      std::vector<int32_t> bad_indptr = in.qo_indptr;
      std::vector<int32_t> bad_indices = in.kv_indices;
      PrefillArgs bad = args;
      absl::StatusCode want = absl::StatusCode::kInvalidArgument;
      switch (it % 4) {
        case 0:
          bad_indptr.back() += 1;  // does not end at total_q
          bad.qo_indptr = bad_indptr;
          break;
        case 1:
          bad_indices.push_back(g.num_pages + 7);  // out of range (kv_indptr now short too)
          bad.kv_indices = bad_indices;
          break;
        case 2:
          bad.layer = g.num_layers;  // out of range
          break;
        case 3:  // one sequence over the other tenant's page
          bad_indices = {other_page};
          bad_indptr = {0, static_cast<int32_t>(in.total_q())};
          bad.kv_indices = bad_indices;
          bad.qo_indptr = bad_indptr;
          bad.kv_indptr = kOnePage;
          bad.kv_last_page_len = kLastLenOne;
          want = absl::StatusCode::kPermissionDenied;
          break;
      }
      auto out = client.Prefill(bad);
      if (out.status().code() == want) {
        ++tally.rejected_as_expected;
      } else {
        tally.Wrong(absl::StrCat("malformed case ", it % 4, ": ", out.status().ToString()));
      }
    } else if (action < 70) {  // cross-tenant read of a page the other tenant holds
      std::vector<int64_t> other_slot = {int64_t{other_page} * g.page_size};
      auto out = client.ReadKV(0, other_slot);
      if (out.status().code() == absl::StatusCode::kPermissionDenied) {
        ++tally.rejected_as_expected;
      } else {
        tally.Wrong("cross-tenant ReadKV: " + out.status().ToString());
      }
    } else if (action < 80) {  // a deadline of 2 ms: dropped, or served and right
      auto out = short_deadline.Prefill(args);
      if (out.status().code() == absl::StatusCode::kDeadlineExceeded) {
        ++tally.deadline;
      } else if (out.ok()) {
        std::vector<double> o_ref, lse_ref;
        ReferencePrefill(mirror, in, &o_ref, &lse_ref);
        Comparison c = Compare(g.dtype, o_ref, lse_ref, out->o, out->lse);
        if (c.Ok(g.dtype)) {
          ++tally.verified;
        } else {
          tally.Wrong("short-deadline result: " + c.ToString());
        }
      } else {
        tally.Wrong("short deadline: " + out.status().ToString());
      }
    } else if (action < 90) {  // cancelled by the caller while in flight
      grpc::ClientContext ctx;
      client.PrepareContext(&ctx);
      v1::PrefillRequest req;
      // The same request as `args`, built by hand so the call can be cancelled.
      req.set_layer(args.layer);
      auto* q = req.mutable_q();
      q->set_dtype(g.dtype == KvDType::kBf16 ? v1::DTYPE_BF16 : v1::DTYPE_FP16);
      for (int64_t d : {in.total_q(), int64_t{g.num_qo_heads}, int64_t{g.head_dim}}) q->add_shape(d);
      q->set_data(in.q.data(), in.q.size() * sizeof(uint16_t));
      req.mutable_qo_indptr()->Assign(in.qo_indptr.begin(), in.qo_indptr.end());
      req.mutable_kv_indptr()->Assign(in.kv_indptr.begin(), in.kv_indptr.end());
      req.mutable_kv_indices()->Assign(in.kv_indices.begin(), in.kv_indices.end());
      req.mutable_kv_last_page_len()->Assign(in.kv_last_page_len.begin(),
                                             in.kv_last_page_len.end());
      req.set_causal(in.causal);
      req.set_lse_base(in.lse_base_e ? v1::LSE_BASE_E : v1::LSE_BASE_2);
      v1::PrefillResponse resp;
      std::thread canceller([&ctx] {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        ctx.TryCancel();
      });
      grpc::Status s = client.stub()->Prefill(&ctx, req, &resp);
      canceller.join();
      if (s.error_code() == grpc::StatusCode::CANCELLED) {
        ++tally.cancelled;
      } else if (s.ok()) {  // finished before the cancel: must still be right
        std::vector<double> o_ref, lse_ref;
        ReferencePrefill(mirror, in, &o_ref, &lse_ref);
        std::vector<uint16_t> o(resp.output().data().size() / 2);
        std::vector<float> lse(resp.lse().data().size() / 4);
        if (!o.empty()) std::memcpy(o.data(), resp.output().data().data(), o.size() * sizeof(uint16_t));
        if (!lse.empty()) std::memcpy(lse.data(), resp.lse().data().data(), lse.size() * 4);
        Comparison c = Compare(g.dtype, o_ref, lse_ref, o, lse);
        if (c.Ok(g.dtype)) {
          ++tally.verified;
        } else {
          tally.Wrong("cancel race result: " + c.ToString());
        }
      } else {
        tally.Wrong("cancelled call: " + s.error_message());
      }
    } else {  // allocate/free churn
      auto extra = client.AllocatePages(1 + it % 7);
      if (extra.ok()) {
        if (client.FreePages(*extra).ok()) ++tally.churned;
      } else {
        tally.Wrong("churn alloc: " + extra.status().ToString());
      }
    }
    if (absl::Status s = client.FreePages(*pages); !s.ok()) {
      tally.Wrong("FreePages: " + s.ToString());
    }
  }
  (void)test;
}

TEST_F(ChurnTest, TwoTenantsUnderChurnStayCorrectAndLeakNothing) {
  auto probe = Connect("churn-token-a");
  ASSERT_NE(probe, nullptr);
  const KvGeometry g = GeometryOf(probe->info());
  const int32_t free_at_start = probe->info().free_pages();
  const int pid = PidFromOutput(server_->Output());
  ASSERT_GT(pid, 0) << server_->Output();
  const int64_t rss_start = RssKb(pid);

  // Each tenant holds one page throughout; the other tenant aims at it.
  auto a = Connect("churn-token-a");
  auto b = Connect("churn-token-b");
  auto a_page = a->AllocatePages(1);
  auto b_page = b->AllocatePages(1);
  ASSERT_TRUE(a_page.ok() && b_page.ok());
  std::vector<int64_t> a_slots = {int64_t{(*a_page)[0]} * g.page_size};
  std::mt19937_64 gen(5);
  auto a_k = RandomHalves(gen, g.dtype, g.RowElems());
  auto a_v = RandomHalves(gen, g.dtype, g.RowElems());
  ASSERT_TRUE(a->WriteKV(0, a_slots, a_k, a_v).ok());

  Tally tally;
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<Client>> clients, short_clients;
  for (int t = 0; t < kThreads; ++t) {
    const bool alpha = t % 2 == 0;
    clients.push_back(Connect(alpha ? "churn-token-a" : "churn-token-b"));
    short_clients.push_back(Connect(alpha ? "churn-token-a" : "churn-token-b"));
    ASSERT_NE(clients[t], nullptr);
    ASSERT_NE(short_clients[t], nullptr);
    short_clients[t]->set_timeout_s(0.002);
  }
  for (int t = 0; t < kThreads; ++t) {
    const int32_t other = t % 2 == 0 ? (*b_page)[0] : (*a_page)[0];
    threads.emplace_back([&, t, other] {
      ClientLoop(this, *clients[t], *short_clients[t], g, t, other, tally);
    });
  }
  for (auto& th : threads) th.join();

  std::cout << "verified=" << tally.verified << " rejected_as_expected=" << tally.rejected_as_expected
            << " deadline_exceeded=" << tally.deadline << " cancelled=" << tally.cancelled
            << " churned=" << tally.churned << " wrong=" << tally.wrong << "\n";
  for (const auto& e : tally.errors) ADD_FAILURE() << e;
  EXPECT_EQ(tally.wrong.load(), 0);
  EXPECT_GT(tally.verified.load(), kThreads * kIterations / 4);
  EXPECT_GT(tally.rejected_as_expected.load(), 0);
  EXPECT_GT(tally.churned.load(), 0);

  // The other tenant's page is byte-for-byte what alpha wrote.
  auto kv = a->ReadKV(0, a_slots);
  ASSERT_TRUE(kv.ok());
  EXPECT_EQ(kv->k, a_k);
  EXPECT_EQ(kv->v, a_v);
  ASSERT_TRUE(a->FreePages(*a_page).ok());
  ASSERT_TRUE(b->FreePages(*b_page).ok());
  auto info = probe->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->free_pages(), free_at_start);
  const int64_t rss_end = RssKb(pid);
  EXPECT_LT(rss_end - rss_start, kRssGrowthBoundKb) << "RSS " << rss_start << " -> " << rss_end;
  // Still serves a verified request.
  ASSERT_TRUE(server_->Alive());
  std::mt19937_64 gen2(77);
  WorkloadSpec spec;
  auto pages = a->AllocatePages(static_cast<int32_t>(PagesNeeded(g, spec)));
  ASSERT_TRUE(pages.ok());
  PrefillInputs in = RandomPrefill(gen2, g, spec, *pages);
  KvMirror mirror(g);
  PrefillArgs args = ArgsOf(in);
  // Write the pages so that the reference knows them.
  std::vector<int64_t> slots = SlotsOfPages(g, *pages);
  auto k = RandomHalves(gen2, g.dtype, static_cast<int64_t>(slots.size()) * g.RowElems());
  auto v = RandomHalves(gen2, g.dtype, static_cast<int64_t>(slots.size()) * g.RowElems());
  ASSERT_TRUE(a->WriteKV(0, slots, k, v).ok());
  mirror.Write(0, slots, k, v);
  auto out = a->Prefill(args);
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<double> o_ref, lse_ref;
  ReferencePrefill(mirror, in, &o_ref, &lse_ref);
  EXPECT_TRUE(Compare(g.dtype, o_ref, lse_ref, out->o, out->lse).Ok(g.dtype));
  EXPECT_EQ(server_->Stop(), 0);
}

}  // namespace
}  // namespace attnserve
