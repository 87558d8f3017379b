// Leases (docs/security.md, "Leases"): what a client holds under a lease is
// released and zeroed when the lease is not renewed, a request naming a
// lease that is gone gets the typed error instead of touching pages that
// may belong to someone else now, a killed client's pages come back within
// the lease's ttl plus a second, and a tenant can list and release all it
// holds. Also: an idle plan is released by the server's timer alone.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/lease.h"
#include "client/workload.h"
#include "gmock/gmock.h"
#include "grpcpp/support/client_interceptor.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

std::unique_ptr<Client> Connect(const TestServer& server, const std::string& token = "") {
  ClientOptions options;
  options.target = server.grpc_address();
  options.token = token;
  options.timeout_s = 60;
  auto client = Client::Connect(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

double Metric(const TestServer& server, const std::string& name, const std::string& labels) {
  auto text = HttpGet(server.metrics_address(), "/metrics");
  if (!text.ok()) return -1;
  auto value = MetricValue(*text, name, labels);
  return value.ok() ? *value : 0;
}

// Polls until `done` or `limit` passes; returns whether it became true.
template <typename F>
bool WaitFor(F done, absl::Duration limit) {
  const absl::Time until = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// The pages a tenant holds under `lease` (0: under any lease or none).
std::vector<int32_t> HeldPages(Client& client, uint64_t lease) {
  auto listed = client.ListHoldings(lease);
  std::vector<int32_t> pages;
  if (!listed.ok()) return pages;
  for (const auto& l : listed->leases()) {
    pages.insert(pages.end(), l.holdings().page_ids().begin(), l.holdings().page_ids().end());
  }
  pages.insert(pages.end(), listed->unleased().page_ids().begin(),
               listed->unleased().page_ids().end());
  std::sort(pages.begin(), pages.end());
  return pages;
}

class LeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TestServerOptions options;
    options.num_pages = 64;
    auto server = TestServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = Connect(*server_);
    ASSERT_TRUE(client_);
    geo_ = GeometryOf(client_->info());
  }

  // Random K/V into every row of `pages` (layer 0), then one decode row over
  // them (full), as a Prefill naming the pages; the first error of the two.
  absl::StatusOr<PrefillResult> Decode(Client& client, const std::vector<int32_t>& pages,
                                       std::mt19937_64& gen) {
    const std::vector<int64_t> slots = SlotsOfPages(geo_, pages);
    const int64_t n = static_cast<int64_t>(slots.size()) * geo_.RowElems();
    absl::Status written = client.WriteKV(0, slots, RandomHalves(gen, geo_.dtype, n),
                                          RandomHalves(gen, geo_.dtype, n));
    if (!written.ok()) return written;
    const std::vector<uint16_t> q = RandomHalves(gen, geo_.dtype, geo_.num_qo_heads * geo_.head_dim);
    const std::vector<int32_t> qo = {0, 1}, kv = {0, static_cast<int32_t>(pages.size())},
                               last = {geo_.page_size};
    PrefillArgs args;
    args.q = q;
    args.qo_indptr = qo;
    args.kv_indptr = kv;
    args.kv_indices = pages;
    args.kv_last_page_len = last;
    return client.Prefill(args);
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> client_;
  KvGeometry geo_;
};

TEST_F(LeaseTest, AnExpiredLeaseReleasesAndZeroesEverythingUnderItAndSaysSo) {
  const int32_t free_at_start = client_->GetServerInfo()->free_pages();
  auto lease = client_->GrantLease(1000);
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_EQ(lease->ttl_ms, 1000);
  client_->UseLease(lease->id);
  auto pages = client_->AllocatePages(4);
  ASSERT_TRUE(pages.ok()) << pages.status();
  std::mt19937_64 gen(3);
  const std::vector<int64_t> slots = SlotsOfPages(geo_, *pages);
  const int64_t n = static_cast<int64_t>(slots.size()) * geo_.RowElems();
  ASSERT_TRUE(client_->WriteKV(0, slots, RandomHalves(gen, geo_.dtype, n),
                               RandomHalves(gen, geo_.dtype, n))
                  .ok());
  const std::vector<int32_t> qo = {0, 1}, kv = {0, 4}, last = {geo_.page_size};
  auto plan = client_->CreatePlan({qo, kv, *pages, last, {}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(HeldPages(*client_, lease->id), [&] {
    auto p = *pages;
    std::sort(p.begin(), p.end());
    return p;
  }());

  // Nobody renews it: within its ttl (and the reaper's tick) it is gone.
  ASSERT_TRUE(WaitFor([&] { return HeldPages(*client_, 0).empty(); }, absl::Seconds(10)));
  EXPECT_TRUE(WaitFor([&] { return client_->GetServerInfo()->free_pages() == free_at_start; },
                      absl::Seconds(10)))
      << "the lease's pages did not come back to the free list";
  EXPECT_EQ(Metric(*server_, "attnserve_leases_ended_total", "reason=\"expired\""), 1);
  EXPECT_EQ(Metric(*server_, "attnserve_holdings_released_total",
                   "kind=\"pages\",reason=\"expired\""),
            4);
  EXPECT_EQ(Metric(*server_, "attnserve_holdings_released_total",
                   "kind=\"plans\",reason=\"expired\""),
            1);

  // Every request naming the lease gets the typed error.
  PrefillArgs planned;
  const std::vector<uint16_t> q = RandomHalves(gen, geo_.dtype, geo_.num_qo_heads * geo_.head_dim);
  planned.q = q;
  planned.plan_id = *plan;
  for (const absl::Status& s :
       {client_->AllocatePages(1).status(), client_->Prefill(planned).status(),
        client_->WriteKV(0, slots, RandomHalves(gen, geo_.dtype, n),
                         RandomHalves(gen, geo_.dtype, n)),
        client_->FreePages(*pages), client_->KeepAlive(lease->id).status(),
        client_->CreatePlan({qo, kv, *pages, last, {}}).status()}) {
    EXPECT_TRUE(IsLeaseExpired(s)) << s;
    EXPECT_THAT(std::string(s.message()), StartsWith("lease "));
  }
  // Its plan is gone, and its pages were zeroed before anyone could have them.
  client_->UseLease(0);
  EXPECT_EQ(client_->Prefill(planned).status().code(), absl::StatusCode::kNotFound);
  auto all = client_->AllocatePages(free_at_start);
  ASSERT_TRUE(all.ok()) << all.status();
  auto read = client_->ReadKV(0, slots);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(std::all_of(read->k.begin(), read->k.end(), [](uint16_t x) { return x == 0; }))
      << "a released page kept its KV";
  // Revoking a lease that is gone releases nothing and is no error.
  auto revoked = client_->RevokeLease(lease->id);
  ASSERT_TRUE(revoked.ok()) << revoked.status();
  EXPECT_EQ(revoked->page_ids_size(), 0);
}

// The wrong-KV path leases close: a client whose lease expired while it was
// away must not attend over pages that another client of the same tenant
// has since been given.
TEST_F(LeaseTest, AClientBackFromAnExpiredLeaseCannotReadThePagesSomeoneElseNowHolds) {
  auto stale = Connect(*server_);
  ASSERT_TRUE(stale);
  auto lease = stale->GrantLease(1000);
  ASSERT_TRUE(lease.ok());
  stale->UseLease(lease->id);
  auto pages = stale->AllocatePages(geo_.num_pages);  // every page
  ASSERT_TRUE(pages.ok()) << pages.status();
  std::mt19937_64 gen(5);
  ASSERT_TRUE(Decode(*stale, {(*pages)[0]}, gen).ok());
  ASSERT_TRUE(WaitFor([&] { return HeldPages(*client_, 0).empty(); }, absl::Seconds(10)));

  auto fresh = client_->Fork();
  auto keeper = LeaseKeeper::Start(fresh.get());
  ASSERT_TRUE(keeper.ok()) << keeper.status();
  std::vector<int32_t> again;
  ASSERT_TRUE(WaitFor(
      [&] {
        auto got = fresh->AllocatePages(geo_.num_pages);
        if (got.ok()) again = *got;
        return got.ok();
      },
      absl::Seconds(10)));
  ASSERT_TRUE(Decode(*fresh, {(*pages)[0]}, gen).ok());
  // The stale client names its old lease: refused, never served.
  absl::Status s = Decode(*stale, {(*pages)[0]}, gen).status();
  EXPECT_TRUE(IsLeaseExpired(s)) << s;
  // A live lease may not name pages of another lease either.
  auto other = client_->GrantLease(0);
  ASSERT_TRUE(other.ok());
  client_->UseLease(other->id);
  s = Decode(*client_, {(*pages)[0]}, gen).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("not held under lease"));
  EXPECT_FALSE(IsLeaseExpired(s));
  EXPECT_EQ(client_->FreePages({(*pages)[0]}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fresh->info().num_pages(), static_cast<int32_t>(HeldPages(*fresh, (*keeper)->id()).size()))
      << "a refused request changed what the live lease holds";
}

TEST_F(LeaseTest, AKeptLeaseOutlivesItsTtlAndItsKeeperRevokesItOnTheWayOut) {
  auto forked = client_->Fork();
  const int32_t free_at_start = client_->GetServerInfo()->free_pages();
  {
    auto keeper = LeaseKeeper::Start(forked.get(), 2000);
    ASSERT_TRUE(keeper.ok()) << keeper.status();
    EXPECT_EQ(forked->lease_id(), (*keeper)->id());
    EXPECT_EQ(client_->lease_id(), 0u) << "Fork shares the lease";
    auto pages = forked->AllocatePages(3);
    ASSERT_TRUE(pages.ok());
    absl::SleepFor(absl::Milliseconds(5000));  // two and a half ttls
    EXPECT_FALSE((*keeper)->expired()) << (*keeper)->status();
    EXPECT_EQ(HeldPages(*client_, (*keeper)->id()).size(), 3u);
    std::mt19937_64 gen(9);
    EXPECT_TRUE(Decode(*forked, *pages, gen).ok());
  }
  // Destroyed: revoked at once, not a ttl later.
  EXPECT_EQ(forked->lease_id(), 0u);
  EXPECT_EQ(client_->GetServerInfo()->free_pages(), free_at_start)
      << "RevokeLease answers once the pages it freed are zeroed and free";
  EXPECT_EQ(Metric(*server_, "attnserve_leases_ended_total", "reason=\"revoked\""), 1);
  EXPECT_EQ(Metric(*server_, "attnserve_leases_ended_total", "reason=\"expired\""), 0);
}

TEST_F(LeaseTest, AKilledClientsPagesAndPlanComeBackWithinItsTtlAndASecond) {
  const int32_t free_at_start = client_->GetServerInfo()->free_pages();
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(pipe_fds[1], 1);
    close(pipe_fds[0]);
    execl(LEASE_HOLDER_BIN, LEASE_HOLDER_BIN, server_->grpc_address().c_str(), "2000", "8",
          nullptr);
    _exit(127);
  }
  close(pipe_fds[1]);
  char buf[16] = {};
  const ssize_t got = read(pipe_fds[0], buf, sizeof(buf) - 1);
  close(pipe_fds[0]);
  ASSERT_GT(got, 0);
  ASSERT_EQ(std::string(buf), "ready\n");
  auto listed = client_->ListHoldings();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->leases_size(), 1);
  EXPECT_EQ(listed->leases(0).ttl_ms(), 2000);
  EXPECT_EQ(listed->leases(0).holdings().page_ids_size(), 8);
  EXPECT_EQ(listed->leases(0).holdings().plan_ids_size(), 1);
  EXPECT_EQ(listed->unleased().page_ids_size(), 0);

  kill(pid, SIGKILL);
  const absl::Time killed = absl::Now();
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  ASSERT_TRUE(WaitFor([&] { return client_->GetServerInfo()->free_pages() == free_at_start; },
                      absl::Seconds(30)));
  const absl::Duration took = absl::Now() - killed;
  // The lease's deadline is at most its ttl after the kill (its last
  // renewal came before it); the target is that plus a second.
  EXPECT_LE(took, absl::Milliseconds(2000 + 1000)) << "pages came back after " << took;
  listed = client_->ListHoldings();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->leases_size(), 0);
}

TEST_F(LeaseTest, BadLeaseRequestsNameTheFieldAndTheBound) {
  absl::Status s = client_->GrantLease(999).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("ttl_ms=999"));
  s = client_->GrantLease(int64_t{3601} * 1000).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("--lease_max_ttl_s"));
  s = client_->GrantLease(-1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(client_->KeepAlive(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->RevokeLease(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(IsLeaseExpired(client_->KeepAlive(42).status()));
  EXPECT_TRUE(IsLeaseExpired(client_->ListHoldings(42).status()));
  client_->UseLease(42);
  EXPECT_TRUE(IsLeaseExpired(client_->AllocatePages(1).status()));
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->lease_default_ttl_ms(), 30000);
  EXPECT_EQ(info->lease_max_ttl_ms(), 3600000);
}

TEST(LeaseTenantsTest, ATenantListsAndReleasesEverythingItHoldsAndNothingElse) {
  auto tokens = WriteTokensFile("tok-a alice\ntok-b bob\n");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  TestServerOptions options;
  options.num_pages = 64;
  options.extra_flags = {"--auth_tokens_file=" + *tokens};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto alice = Connect(**server, "tok-a");
  auto bob = Connect(**server, "tok-b");
  ASSERT_TRUE(alice && bob);
  auto bob_pages = bob->AllocatePages(5);
  ASSERT_TRUE(bob_pages.ok());
  // alice: 3 pages with no lease (a crashed client without one), 2 under a
  // lease, and a plan over one of the unleased.
  auto unleased = alice->AllocatePages(3);
  ASSERT_TRUE(unleased.ok());
  const int32_t ps = alice->info().page_size();
  const std::vector<int32_t> qo = {0, 1}, kv = {0, 1}, last = {ps};
  auto plan = alice->CreatePlan({qo, kv, {(*unleased)[0]}, last, {}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto lease = alice->GrantLease(0);
  ASSERT_TRUE(lease.ok());
  alice->UseLease(lease->id);
  auto leased = alice->AllocatePages(2);
  ASSERT_TRUE(leased.ok());

  auto listed = alice->ListHoldings();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->leases_size(), 1);
  EXPECT_EQ(listed->leases(0).lease_id(), lease->id);
  EXPECT_GT(listed->leases(0).remaining_ms(), 0);
  EXPECT_EQ(listed->leases(0).holdings().page_ids_size(), 2);
  EXPECT_EQ(listed->unleased().page_ids_size(), 3);
  EXPECT_EQ(listed->unleased().plan_ids_size(), 1);
  EXPECT_EQ(listed->unleased().plan_ids(0), *plan);
  auto bob_listed = bob->ListHoldings();
  ASSERT_TRUE(bob_listed.ok());
  EXPECT_EQ(bob_listed->unleased().page_ids_size(), 5) << "bob sees alice's holdings";
  // Another tenant's lease id is unknown to bob.
  bob->UseLease(lease->id);
  EXPECT_TRUE(IsLeaseExpired(bob->AllocatePages(1).status()));
  EXPECT_TRUE(IsLeaseExpired(bob->ListHoldings(lease->id).status()));
  bob->UseLease(0);

  auto released = alice->ReleaseHoldings();
  ASSERT_TRUE(released.ok()) << released.status();
  EXPECT_EQ(released->page_ids_size(), 5);
  EXPECT_EQ(released->plan_ids_size(), 1);
  listed = alice->ListHoldings(0);
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->leases_size(), 0);
  EXPECT_EQ(listed->unleased().page_ids_size(), 0);
  EXPECT_TRUE(IsLeaseExpired(alice->AllocatePages(1).status())) << "the lease outlived ReleaseHoldings";
  bob_listed = bob->ListHoldings();
  ASSERT_TRUE(bob_listed.ok());
  EXPECT_EQ(bob_listed->unleased().page_ids_size(), 5) << "alice's release touched bob's pages";
  EXPECT_EQ(Metric(**server, "attnserve_holdings_released_total",
                   "kind=\"pages\",reason=\"release_holdings\""),
            5);
  unlink(tokens->c_str());
}

// An idle plan is released by the server's timer, without waiting for the
// next CreatePlan (before, FreePages of its pages kept failing until one).
// Counts the KeepAlive calls a client starts and records how each ended.
class KeepAliveCalls {
 public:
  std::function<std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>(
      const std::string&)>
  Interceptors() {
    return [this](const std::string&) {
      std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> out;
      out.push_back(std::make_unique<Factory>(this));
      return out;
    };
  }
  int started() {
    absl::MutexLock lock(&mu_);
    return started_;
  }
  std::vector<grpc::StatusCode> ended() {
    absl::MutexLock lock(&mu_);
    return ended_;
  }

 private:
  class Interceptor final : public grpc::experimental::Interceptor {
   public:
    explicit Interceptor(KeepAliveCalls* calls) : calls_(calls) {}
    void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
      using grpc::experimental::InterceptionHookPoints;
      if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
        absl::MutexLock lock(&calls_->mu_);
        ++calls_->started_;
      }
      if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_STATUS)) {
        absl::MutexLock lock(&calls_->mu_);
        calls_->ended_.push_back(m->GetRecvStatus()->error_code());
      }
      m->Proceed();
    }

   private:
    KeepAliveCalls* calls_;
  };
  class Factory final : public grpc::experimental::ClientInterceptorFactoryInterface {
   public:
    explicit Factory(KeepAliveCalls* calls) : calls_(calls) {}
    grpc::experimental::Interceptor* CreateClientInterceptor(
        grpc::experimental::ClientRpcInfo* info) override {
      return absl::EndsWith(info->method(), "/KeepAlive") ? new Interceptor(calls_) : nullptr;
    }

   private:
    KeepAliveCalls* calls_;
  };
  absl::Mutex mu_;
  int started_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<grpc::StatusCode> ended_ ABSL_GUARDED_BY(mu_);
};

// A keeper abandoned while its renewal waits on a server that does not
// answer (stopped here; unreachable in a cluster) cancels that renewal: it
// could wait up to the lease's ttl, and a cluster abandons the lease of a
// server it found unreachable from its own calls.
TEST(LeaseKeeperTest, AbandonCancelsARenewalInFlight) {
  TestServerOptions options;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  KeepAliveCalls calls;
  ClientOptions co;
  co.target = (*server)->grpc_address();
  co.timeout_s = 60;
  co.interceptors = calls.Interceptors();
  auto client = Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status();
  auto keeper = LeaseKeeper::Start(client->get(), /*ttl_ms=*/6000);  // renewed every 2 s
  ASSERT_TRUE(keeper.ok()) << keeper.status();
  ASSERT_EQ(kill((*server)->pid(), SIGSTOP), 0);
  for (int i = 0; i < 400 && calls.started() == 0; ++i) absl::SleepFor(absl::Milliseconds(25));
  ASSERT_EQ(calls.started(), 1) << "no renewal began";
  absl::SleepFor(absl::Milliseconds(200));  // on its way, unanswered
  (*keeper)->Abandon();
  ASSERT_EQ(kill((*server)->pid(), SIGCONT), 0);
  EXPECT_THAT(calls.ended(), ::testing::ElementsAre(grpc::StatusCode::CANCELLED));
}

// A renewal answered by a restarted server (a stale incarnation: every lease
// ended with the old server) stops the keeper, whose status() says why;
// expired() stays false (the restart is what to act on). Before, it renewed
// every quarter period for ever.
TEST(LeaseKeeperTest, AServerRestartStopsTheKeeper) {
  auto first = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->grpc_address();
  KeepAliveCalls calls;
  ClientOptions co;
  co.target = address;
  co.timeout_s = 10;
  co.interceptors = calls.Interceptors();
  auto client = Client::Connect(co);
  ASSERT_TRUE(client.ok()) << client.status();
  auto keeper = LeaseKeeper::Start(client->get(), /*ttl_ms=*/1000);  // renewed every 333 ms
  ASSERT_TRUE(keeper.ok()) << keeper.status();
  ASSERT_EQ((*first)->Stop(), 0);
  TestServerOptions options;
  options.extra_flags = {absl::StrCat("--listen=", address)};
  auto second = TestServer::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  for (int i = 0; i < 400 && (*keeper)->status().ok(); ++i) absl::SleepFor(absl::Milliseconds(25));
  EXPECT_TRUE(IsStaleIncarnation((*keeper)->status())) << (*keeper)->status();
  EXPECT_FALSE((*keeper)->expired());
  const int started = calls.started();
  absl::SleepFor(absl::Milliseconds(1500));  // four and a half periods
  EXPECT_EQ(calls.started(), started) << "the keeper renewed after the restart was found";
  (*keeper)->Abandon();
}

TEST(PlanIdleTimeoutTest, AnIdlePlanIsReleasedWithoutAnotherCreatePlan) {
  TestServerOptions options;
  options.extra_flags = {"--plan_idle_timeout_s=1"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Connect(**server);
  ASSERT_TRUE(client);
  auto pages = client->AllocatePages(2);
  ASSERT_TRUE(pages.ok());
  const int32_t ps = client->info().page_size();
  const std::vector<int32_t> qo = {0, 1}, kv = {0, 2}, last = {ps};
  auto plan = client->CreatePlan({qo, kv, *pages, last, {}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(client->FreePages(*pages).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(WaitFor([&] { return client->FreePages(*pages).ok(); }, absl::Seconds(10)))
      << "the idle plan still pins its pages";
}

}  // namespace
}  // namespace attnserve
