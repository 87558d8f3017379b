// KvManager (client/kv_manager.h) under injected failures: a random
// workload of plans, every layer's run, finishes and releases over many
// sequences, against the real attnserve binary (CPU backend), while
// FaultInjector (tests/client/fault_injection.h) fails calls at random
// (unreachable, or completed on the server with the reply lost), the test
// revokes the manager's lease now and then (as an expiry would) and
// restarts the server. Every Run() that returns OK is compared, sequence by
// sequence, with the float64 reference over the K/V the test believes each
// sequence has: a wrong result is counted, and there must be none. At the
// end nothing may be left held: with the lease, the tenant holds no page
// and no plan; without it, no more pages than the manager reports leaked.
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/kv_manager.h"
#include "client/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/fault_injection.h"
#include "tests/client/sequence_model.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

struct Params {
  bool lease = true;
  bool server_plans = true;
  int rounds = 0;
  int min_injected = 0;  // this instance's share of the 10,000 of issue #29
  uint64_t seed = 0;
};

// Fast reconnection to a restarted server (the default first backoff is 1 s).
constexpr char kReconnectArgs[] =
    "grpc.initial_reconnect_backoff_ms=20,grpc.min_reconnect_backoff_ms=20,"
    "grpc.max_reconnect_backoff_ms=100";

class KvManagerFaultsTest : public ::testing::TestWithParam<Params> {
 protected:
  void SetUp() override {
    const Params& p = GetParam();
    // The servers (and the cluster's merge) run OpenMP over a few rows: one
    // thread that sleeps when idle instead of spinning on a loaded host.
    setenv("OMP_NUM_THREADS", "1", 1);
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    options_.num_layers = 2;
    options_.num_pages = 1024;
    options_.page_size = 4;
    options_.num_qo_heads = 2;
    options_.num_kv_heads = 1;
    options_.head_dim = 64;
    auto server = TestServer::Start(options_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    options_.extra_flags = {absl::StrCat("--listen=", server_->grpc_address())};
    faults_ = std::make_shared<FaultInjector>(p.seed);
    faults_->Exempt("KeepAlive");  // the keeper's renewals, in the background
    ClientOptions co;
    co.target = server_->grpc_address();
    co.timeout_s = 30;
    co.grpc_args = kReconnectArgs;
    co.interceptors = faults_->Interceptors();
    auto client = Client::Connect(co);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    co.interceptors = nullptr;
    auto admin = Client::Connect(co);
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = *std::move(admin);
    geo_ = GeometryOf(client_->info());
    model_ = std::make_unique<SequenceModel>(geo_);
    KvManagerOptions mo;
    mo.lease = p.lease;
    mo.server_plans = p.server_plans;
    mgr_ = std::make_unique<KvManager>(client_.get(), mo);
    gen_.seed(p.seed * 7 + 1);
  }

  void TearDown() override {
    std::printf(
        "[faults] lease=%d server_plans=%d rounds=%d: injected %lld (unreachable %lld, reply "
        "lost %lld), lease revocations %lld, restarts %lld; runs checked %lld (sequences %lld), "
        "runs refused after a failed run %lld, sequences lost %lld, wrong results %lld\n",
        GetParam().lease, GetParam().server_plans, GetParam().rounds,
        static_cast<long long>(faults_->injected()),
        static_cast<long long>(faults_->injected(Fault::kUnreachable)),
        static_cast<long long>(faults_->injected(Fault::kReplyLost)),
        static_cast<long long>(revocations_), static_cast<long long>(restarts_),
        static_cast<long long>(runs_checked_), static_cast<long long>(seqs_checked_),
        static_cast<long long>(refusals_), static_cast<long long>(lost_),
        static_cast<long long>(wrong_));
  }

  // The server restarts on the same port: every sequence is gone.
  void Restart() {
    ASSERT_EQ(server_->Stop(), 0);
    server_.reset();
    auto server = TestServer::Start(options_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ++restarts_;
    admin_->ForgetIncarnation();
  }

  // What docs/kv_manager.md says to do after a restart.
  void OnRestart() {
    mgr_->Reset();
    client_->ForgetIncarnation();
    model_->Clear();
    len_.clear();
    leaked_before_restart_ = mgr_->Leaked();
  }

  // Sequences a call reported lost: gone from the model; Finish() of them
  // succeeds without the server.
  void OnLost(const absl::Status& s) {
    Log(s.ToString());
    std::vector<int64_t> ids = LostSequences(s);
    ASSERT_FALSE(ids.empty()) << s;
    for (int64_t id : ids) {
      EXPECT_TRUE(len_.contains(id)) << "lost sequence " << id << " was never planned";
      EXPECT_TRUE(mgr_->Has(id));
      EXPECT_EQ(mgr_->KvLen(id), -1);
      len_.erase(id);
      model_->Erase(id);
    }
    lost_ += static_cast<int64_t>(ids.size());
    absl::Status finished = mgr_->Finish(ids);
    EXPECT_TRUE(finished.ok()) << finished << Trace();
    for (int64_t id : ids) EXPECT_FALSE(mgr_->Has(id));
  }

  // The answer of any call: losses and restarts handled; true when the
  // sequences the test knows are still as it knows them.
  bool Settle(const absl::Status& s) {
    if (s.code() == absl::StatusCode::kDataLoss) {
      OnLost(s);
      return false;
    }
    if (IsStaleIncarnation(s)) {
      OnRestart();
      return false;
    }
    EXPECT_NE(s.code(), absl::StatusCode::kInvalidArgument) << s << Trace();
    EXPECT_NE(s.code(), absl::StatusCode::kNotFound) << s << Trace();
    EXPECT_NE(s.code(), absl::StatusCode::kPermissionDenied) << s << Trace();
    return true;
  }

  std::string Trace() {
    std::string out = "\nlast calls:";
    for (const std::string& t : trace_) out += "\n  " + t;
    return out;
  }
  void Log(std::string what) {
    trace_.push_back(std::move(what));
    if (trace_.size() > 40) trace_.erase(trace_.begin());
  }

  void Finish(std::vector<int64_t> ids) {
    absl::Status s = mgr_->Finish(ids);
    Log(absl::StrCat("Finish ", absl::StrJoin(ids, ","), ": ", s.ToString(),
                     " faults=", faults_->injected()));
    // Forgotten whatever happened.
    for (int64_t id : ids) {
      EXPECT_FALSE(mgr_->Has(id)) << "sequence " << id << " after Finish: " << s;
      len_.erase(id);
      model_->Erase(id);
    }
    if (!s.ok()) Settle(s);
  }

  void Step() {
    std::vector<int64_t> ids;
    std::vector<int32_t> q_lens;
    std::vector<int64_t> known;
    for (const auto& [id, len] : len_) known.push_back(id);
    std::sort(known.begin(), known.end());
    std::shuffle(known.begin(), known.end(), gen_);
    for (int64_t id : known) {
      if (ids.size() >= 4) break;
      ids.push_back(id);
      q_lens.push_back(1 + static_cast<int32_t>(gen_() % 3));
    }
    const int starts = len_.size() < 8 ? static_cast<int>(gen_() % 3) : 0;
    for (int i = 0; i < starts || ids.empty(); ++i) {
      ids.push_back(next_id_++);
      q_lens.push_back(1 + static_cast<int32_t>(gen_() % 12));
    }
    auto plan = mgr_->Plan(ids, q_lens);
    Log(absl::StrCat(
        "Plan ", absl::StrJoin(ids, ","), ": ", plan.status().ToString(),
        " faults=", faults_->injected(),
        plan.ok() ? absl::StrCat(" pages ", absl::StrJoin((*plan)->kv_indices, ",")) : ""));
    if (!plan.ok()) {
      if (!Settle(plan.status())) return;
      EXPECT_NE(plan.status().code(), absl::StatusCode::kFailedPrecondition) << plan.status();
      // Atomic: nothing changed.
      for (int64_t id : ids) {
        EXPECT_EQ(mgr_->KvLen(id), len_.contains(id) ? len_[id] : -1) << plan.status();
      }
      return;
    }
    const StepPlan& p = **plan;
    std::vector<SequenceModel::Part> parts;
    for (size_t b = 0; b < ids.size(); ++b) {
      const int64_t before = len_.contains(ids[b]) ? len_[ids[b]] : 0;
      EXPECT_EQ(p.kv_lens[b], before + q_lens[b]);
      parts.push_back({ids[b], p.qo_indptr[b], q_lens[b], p.kv_lens[b]});
      len_[ids[b]] = p.kv_lens[b];  // the rows follow layer by layer
    }
    const int64_t n = p.total_q();
    for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
      const auto q = RandomHalves(gen_, geo_.dtype, n * geo_.num_qo_heads * geo_.head_dim);
      const auto k = RandomHalves(gen_, geo_.dtype, n * geo_.RowElems());
      const auto v = RandomHalves(gen_, geo_.dtype, n * geo_.RowElems());
      bool done = false;
      for (int attempt = 0; attempt < 3 && !done; ++attempt) {
        auto out = mgr_->Run(layer, q, k, v, &p);
        Log(absl::StrCat("Run ", layer, ": ", out.status().ToString(),
                         " faults=", faults_->injected()));
        if (!out.ok()) {
          if (!Settle(out.status())) return;
          continue;
        }
        done = true;
        for (const auto& part : parts) {
          const int64_t start = part.kv_len - part.q_len;
          const int64_t e = geo_.RowElems();
          model_->Write(part.seq, layer, start,
                        absl::MakeConstSpan(k).subspan(part.row * e, part.q_len * e),
                        absl::MakeConstSpan(v).subspan(part.row * e, part.q_len * e));
        }
        for (const auto& [id, why] : model_->Check(layer, parts, q, out->o, out->lse)) {
          ++wrong_;
          ADD_FAILURE() << "wrong result: sequence " << id << " layer " << layer << ": " << why;
        }
        ++runs_checked_;
        seqs_checked_ += static_cast<int64_t>(parts.size());
      }
      if (!done) {
        // A failed Run() of this layer: the sequences are refused until it
        // runs again (or they finish). Here they finish.
        std::vector<int32_t> ones(ids.size(), 1);
        auto refused = mgr_->Plan(ids, ones);
        EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
            << refused.status();
        EXPECT_THAT(refused.status().message(), HasSubstr(absl::StrCat("layer ", layer)));
        ++refusals_;
        Finish(ids);
        return;
      }
      MaybeDisturb();
    }
  }

  // Between the layers of a step: the lease revoked (as its expiry would)
  // or the server restarted, sometimes.
  void MaybeDisturb() {
    if (restart_due_) {
      restart_due_ = false;
      Restart();
      return;
    }
    if (GetParam().lease && mgr_->lease_id() != 0 && gen_() % 50 == 0) {
      EXPECT_TRUE(admin_->RevokeLease(mgr_->lease_id()).ok());
      Log("revoked");
      ++revocations_;
    }
  }

  void Workload() {
    const Params& p = GetParam();
    faults_->SetRates(0.2, 0.2);
    // How many calls a round makes, and so how many faults it draws,
    // depends on the host's timing: past its scheduled rounds the workload
    // runs on (no more restarts; at most as many rounds again) until it has
    // injected its share.
    for (int round = 0;
         round < p.rounds || (round < 2 * p.rounds && faults_->injected() < p.min_injected);
         ++round) {
      if (round > 0 && round < p.rounds && round % (p.rounds / 3 + 1) == 0) {
        if (restart_due_) Restart();
        restart_due_ = true;  // between two layers of the next step
        if (HasFatalFailure()) return;
      }
      const int action = static_cast<int>(gen_() % 100);
      if (action < 2) {
        absl::Status s = mgr_->Release();
        Log(absl::StrCat("Release: ", s.ToString()));
        EXPECT_TRUE(mgr_->Sequences().empty() && mgr_->Lost().empty());
        model_->Clear();
        len_.clear();
        if (!s.ok()) Settle(s);
      } else if (action < 25 && !len_.empty()) {
        std::vector<int64_t> ids;
        for (const auto& [id, len] : len_) {
          if (gen_() % 3 == 0) ids.push_back(id);
        }
        if (!ids.empty()) Finish(ids);
      } else {
        Step();
      }
      if (HasFatalFailure()) return;
      if (p.lease) {
        // A manager with a lease holds nothing outside it.
        auto held = admin_->ListHoldings(0);
        ASSERT_TRUE(held.ok()) << held.status();
        ASSERT_EQ(held->unleased().page_ids_size() + held->unleased().plan_ids_size(), 0)
            << "round " << round << Trace();
      }
    }
  }

  // Injection off: release, and check that nothing is held any more.
  void CheckNothingHeld() {
    if (restart_due_) Restart();  // no step reached its layers since it was due
    if (HasFatalFailure()) return;
    faults_->SetRates(0, 0);
    if (!GetParam().lease) {
      // Without a lease, plans whose CreatePlan reply was lost are nobody's
      // (the server drops them after --plan_idle_timeout_s) and pin pages
      // the manager waits to free: gone now.
      auto held = admin_->ListHoldings(0);
      ASSERT_TRUE(held.ok()) << held.status();
      for (uint64_t id : held->unleased().plan_ids()) {
        absl::Status s = admin_->ReleasePlan(id);
        EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kNotFound) << s;
      }
    }
    absl::Status released = mgr_->Release();
    if (IsStaleIncarnation(released)) {
      OnRestart();
      released = mgr_->Release();
    }
    ASSERT_TRUE(released.ok()) << released;
    auto held = admin_->ListHoldings(0);
    ASSERT_TRUE(held.ok()) << held.status();
    int64_t leased_pages = 0, leased_plans = 0;
    for (const v1::LeaseInfo& l : held->leases()) {
      leased_pages += l.holdings().page_ids_size();
      leased_plans += l.holdings().plan_ids_size();
    }
    EXPECT_EQ(leased_pages, 0);
    EXPECT_EQ(leased_plans, 0);
    if (GetParam().lease) {
      EXPECT_EQ(held->unleased().page_ids_size(), 0);
      EXPECT_EQ(held->unleased().plan_ids_size(), 0);
      // Revoked pages are zeroed before they count as free: wait for it.
      int32_t free_pages = 0;
      for (int i = 0; i < 1000 && free_pages != options_.num_pages; ++i) {
        if (i > 0) absl::SleepFor(absl::Milliseconds(10));
        auto info = admin_->GetServerInfo();
        ASSERT_TRUE(info.ok()) << info.status();
        free_pages = info->free_pages();
      }
      EXPECT_EQ(free_pages, options_.num_pages);
      return;
    }
    // Without a lease, only pages the manager reports leaked may stay held.
    EXPECT_EQ(held->unleased().plan_ids_size(), 0);
    EXPECT_LE(held->unleased().page_ids_size(), mgr_->Leaked() - leaked_before_restart_);
  }

  TestServerOptions options_;
  std::unique_ptr<TestServer> server_;
  std::shared_ptr<FaultInjector> faults_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Client> admin_;  // no faults: checks and revocations
  KvGeometry geo_;
  std::unique_ptr<SequenceModel> model_;
  std::unique_ptr<KvManager> mgr_;
  std::mt19937_64 gen_;
  absl::flat_hash_map<int64_t, int64_t> len_;  // the sequences the test knows, and lengths
  int64_t next_id_ = 1;
  int64_t leaked_before_restart_ = 0;
  int64_t wrong_ = 0, runs_checked_ = 0, seqs_checked_ = 0, refusals_ = 0, lost_ = 0;
  int64_t revocations_ = 0, restarts_ = 0;
  std::vector<std::string> trace_;
  bool restart_due_ = false;
};

TEST_P(KvManagerFaultsTest, NoWrongResultAndNothingLeftHeld) {
  Workload();
  if (HasFatalFailure()) return;
  CheckNothingHeld();
  EXPECT_EQ(wrong_, 0);
  EXPECT_GE(faults_->injected(), GetParam().min_injected);
  EXPECT_GE(runs_checked_, GetParam().rounds / 3);
  EXPECT_GT(refusals_, 0);
  EXPECT_EQ(restarts_, 2);
}

INSTANTIATE_TEST_SUITE_P(Modes, KvManagerFaultsTest,
                         // About 1.0-1.4 injected faults per round.
                         ::testing::Values(Params{true, true, 900, 900, 1},
                                           Params{true, false, 1000, 900, 2},
                                           Params{false, true, 900, 900, 3},
                                           Params{false, false, 1200, 900, 4}),
                         [](const auto& info) {
                           return std::string(info.param.lease ? "Lease" : "NoLease") +
                                  (info.param.server_plans ? "ServerPlans" : "Layout");
                         });

}  // namespace
}  // namespace attnserve

namespace attnserve {
namespace {

// One failure at a time, each at the step where it hurts.
class KvManagerFailureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("OMP_NUM_THREADS", "1", 1);
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    TestServerOptions o;
    o.num_layers = 2;
    o.num_pages = 64;
    o.page_size = 4;
    o.num_qo_heads = 2;
    o.num_kv_heads = 1;
    o.head_dim = 64;
    auto server = TestServer::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    faults_ = std::make_shared<FaultInjector>(5);
    ClientOptions co;
    co.target = server_->grpc_address();
    co.timeout_s = 30;
    co.interceptors = faults_->Interceptors();
    auto client = Client::Connect(co);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    co.interceptors = nullptr;
    auto admin = Client::Connect(co);
    ASSERT_TRUE(admin.ok()) << admin.status();
    admin_ = *std::move(admin);
    geo_ = GeometryOf(client_->info());
  }

  // Every layer of the latest plan of `mgr`, with random rows of n tokens.
  absl::Status RunAll(KvManager& mgr, int64_t n) {
    for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
      auto out =
          mgr.Run(layer, RandomHalves(gen_, geo_.dtype, n * geo_.num_qo_heads * geo_.head_dim),
                  RandomHalves(gen_, geo_.dtype, n * geo_.RowElems()),
                  RandomHalves(gen_, geo_.dtype, n * geo_.RowElems()));
      if (!out.ok()) return out.status();
    }
    return absl::OkStatus();
  }

  // Pages and plans the tenant holds: under `lease` (0: under no lease).
  std::pair<std::vector<int32_t>, std::vector<uint64_t>> Held(uint64_t lease) {
    auto held = admin_->ListHoldings(0);
    EXPECT_TRUE(held.ok()) << held.status();
    std::pair<std::vector<int32_t>, std::vector<uint64_t>> out;
    const v1::Holdings* h = lease == 0 ? &held->unleased() : nullptr;
    for (const v1::LeaseInfo& l : held->leases()) {
      if (l.lease_id() == lease) h = &l.holdings();
    }
    if (h == nullptr) return out;
    out.first.assign(h->page_ids().begin(), h->page_ids().end());
    out.second.assign(h->plan_ids().begin(), h->plan_ids().end());
    return out;
  }

  static std::vector<int32_t> Sorted(std::vector<int32_t> v) {
    std::sort(v.begin(), v.end());
    return v;
  }

  std::unique_ptr<TestServer> server_;
  std::shared_ptr<FaultInjector> faults_;
  std::unique_ptr<Client> client_, admin_;
  KvGeometry geo_;
  std::mt19937_64 gen_{29};
};

TEST_F(KvManagerFailureTest, WithTheLeaseWhatAFailedCallLeftInDoubtIsReconciled) {
  KvManager mgr(client_.get());
  ASSERT_TRUE(mgr.Plan({1, 2}, {8, 8}).ok());
  const uint64_t lease = mgr.lease_id();
  ASSERT_NE(lease, 0u);

  // FreePages never reaches the server: the pages stay held under the lease.
  faults_->FailNext("FreePages", Fault::kUnreachable);
  EXPECT_EQ(mgr.Finish({1}).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(mgr.KvLen(1), -1);
  EXPECT_EQ(Held(lease).first.size(), 4u);
  // AllocatePages completes on the server, but its reply is lost. (The
  // plan reconciled first: 1's pages are freed.)
  faults_->FailNext("AllocatePages", Fault::kReplyLost);
  EXPECT_EQ(mgr.Plan({3}, {4}).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(mgr.KvLen(3), -1);
  EXPECT_EQ(Held(lease).first.size(), 3u);  // 2's, and the one nobody knows
  // CreatePlan completes on the server, but its reply is lost. (1's plan,
  // which 2 shared, was released by the reconciliation.)
  faults_->FailNext("CreatePlan", Fault::kReplyLost);
  EXPECT_EQ(mgr.Plan({2}, {4}).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(mgr.KvLen(2), 8);
  EXPECT_EQ(Held(lease).second.size(), 1u);  // the plan nobody knows

  // The next call that allocates reconciles first: the lease then holds
  // exactly the live sequences' pages and plans.
  auto plan = mgr.Plan({4}, {4});
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<int32_t> live = mgr.PagesOf(2);
  for (int32_t p : mgr.PagesOf(4)) live.push_back(p);
  EXPECT_EQ(Sorted(Held(lease).first), Sorted(live));
  EXPECT_EQ(Held(lease).second, std::vector<uint64_t>{(*plan)->plan_id});
  EXPECT_TRUE(RunAll(mgr, 4).ok());
  ASSERT_TRUE(mgr.Release().ok());
  EXPECT_TRUE(Held(lease).first.empty());
  EXPECT_EQ(mgr.Leaked(), 0);
}

TEST_F(KvManagerFailureTest, WithoutALeaseAFreeWhoseOutcomeIsUnknownIsLeakedNeverRetried) {
  KvManagerOptions options;
  options.lease = false;
  KvManager mgr(client_.get(), options);
  ASSERT_TRUE(mgr.Plan({1, 2}, {8, 8}).ok());
  EXPECT_EQ(mgr.lease_id(), 0u);
  const std::vector<int32_t> pages_2 = mgr.PagesOf(2);
  faults_->FailNext("FreePages", Fault::kUnreachable);
  EXPECT_EQ(mgr.Finish({1}).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(mgr.KvLen(1), -1);
  EXPECT_EQ(mgr.Leaked(), 2);
  // The manager never frees them: another client of the tenant may hold
  // them by now. (Here they are still held: attnctl release-all, or a
  // lease, gets them back.)
  ASSERT_TRUE(mgr.Release().ok());
  EXPECT_EQ(Held(0).first.size(), 2u);
  for (int32_t p : Held(0).first) {
    EXPECT_THAT(pages_2, ::testing::Not(::testing::Contains(p)));
  }
}

TEST_F(KvManagerFailureTest, AnExpiredLeaseLosesEverySequenceAndFinishNeedsNoServer) {
  KvManager mgr(client_.get());
  ASSERT_TRUE(mgr.Plan({1, 2}, {8, 3}).ok());
  ASSERT_TRUE(RunAll(mgr, 11).ok());
  const uint64_t lease = mgr.lease_id();
  ASSERT_TRUE(admin_->RevokeLease(lease).ok());  // as its expiry would
  auto run = mgr.Run(0, RandomHalves(gen_, geo_.dtype, geo_.num_qo_heads * geo_.head_dim),
                     RandomHalves(gen_, geo_.dtype, geo_.RowElems()),
                     RandomHalves(gen_, geo_.dtype, geo_.RowElems()));
  EXPECT_EQ(run.status().code(), absl::StatusCode::kDataLoss) << run.status();
  EXPECT_EQ(mgr.Lost(), (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(mgr.Sequences().empty());
  EXPECT_EQ(mgr.Plan({2}, {1}).status().code(), absl::StatusCode::kDataLoss);
  // Finishing them needs no server.
  faults_->SetDown(server_->grpc_address(), true);
  EXPECT_TRUE(mgr.Finish({1, 2}).ok());
  faults_->SetDown(server_->grpc_address(), false);
  EXPECT_TRUE(mgr.Lost().empty());
  // New sequences get a new lease.
  ASSERT_TRUE(mgr.Plan({3}, {2}).ok());
  EXPECT_NE(mgr.lease_id(), lease);
  EXPECT_TRUE(RunAll(mgr, 2).ok());
}

TEST_F(KvManagerFailureTest, AFailedRunRefusesThePlanUntilTheLayerRunsAgain) {
  KvManager mgr(client_.get());
  auto plan = mgr.Plan({7, 9}, {3, 2});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto q = RandomHalves(gen_, geo_.dtype, 5 * geo_.num_qo_heads * geo_.head_dim);
  const auto k = RandomHalves(gen_, geo_.dtype, 5 * geo_.RowElems());
  const auto v = RandomHalves(gen_, geo_.dtype, 5 * geo_.RowElems());
  ASSERT_TRUE(mgr.Run(0, q, k, v, plan->get()).ok());
  faults_->FailNext("Prefill", Fault::kReplyLost);  // layer 1 may or may not be appended
  EXPECT_EQ(mgr.Run(1, q, k, v, plan->get()).status().code(), absl::StatusCode::kDeadlineExceeded);
  auto refused = mgr.Plan({9, 7}, {1, 1});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("sequences 9, 7: layer 1 of step 1"));
  EXPECT_EQ(mgr.KvLen(9), 2);
  EXPECT_TRUE(mgr.Plan({11}, {1}).ok());  // other sequences are not held up
  // The layer again, with the same rows: the sequences move on.
  ASSERT_TRUE(mgr.Run(1, q, k, v, plan->get()).ok());
  EXPECT_TRUE(mgr.Plan({9, 7}, {1, 1}).ok());
}

TEST_F(KvManagerFailureTest, FinishingPartOfAPlanWhoseRunFailedSaysTheRestCanOnlyBeFinished) {
  KvManager mgr(client_.get());
  auto plan = mgr.Plan({7, 9}, {3, 2});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto q = RandomHalves(gen_, geo_.dtype, 5 * geo_.num_qo_heads * geo_.head_dim);
  const auto k = RandomHalves(gen_, geo_.dtype, 5 * geo_.RowElems());
  ASSERT_TRUE(mgr.Run(0, q, k, k, plan->get()).ok());
  faults_->FailNext("Prefill", Fault::kReplyLost);
  EXPECT_EQ(mgr.Run(1, q, k, k, plan->get()).status().code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(mgr.Finish({7}).ok());  // the plan goes stale
  auto refused = mgr.Plan({9}, {1});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("sequences 9: layer 1 of step 1: a Run() of that layer failed or never "
                        "completed, and that plan can no longer run (Finish() of another of its "
                        "sequences, or its loss, made it stale), so their K/V of that step may "
                        "never be written: Finish() the sequences"));
  EXPECT_EQ(mgr.Run(1, q, k, k, plan->get()).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(mgr.Finish({9}).ok());
  EXPECT_TRUE(mgr.Plan({9}, {2}).ok());  // a new sequence under the same id
}

TEST_F(KvManagerFailureTest, ASequenceLostMidStepLeavesTheRestOfItsPlanToBeFinished) {
  KvManager mgr(client_.get());
  auto plan = mgr.Plan({1, 2}, {4, 4});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto q = RandomHalves(gen_, geo_.dtype, 8 * geo_.num_qo_heads * geo_.head_dim);
  const auto k = RandomHalves(gen_, geo_.dtype, 8 * geo_.RowElems());
  ASSERT_TRUE(mgr.Run(0, q, k, k, plan->get()).ok());
  // A lost reply leaves the holdings in doubt; then a client of the tenant
  // without the lease frees 1's pages behind the manager's back, which the
  // next reconciliation finds.
  faults_->FailNext("AllocatePages", Fault::kReplyLost);
  EXPECT_EQ(mgr.Plan({3}, {4}).status().code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(admin_->ReleasePlan((*plan)->plan_id).ok());
  ASSERT_TRUE(admin_->FreePages(mgr.PagesOf(1)).ok());
  auto lost = mgr.Plan({4}, {4});
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(lost.status().message(), HasSubstr("1"));
  // 2 keeps its rows of layer 0, but layer 1 of its step can never run now:
  // a later step would attend over rows never written.
  auto refused = mgr.Plan({2}, {1});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("sequences 2: layer 1 of step 1: a Run() of that layer failed or never "
                        "completed, and that plan can no longer run"));
  EXPECT_EQ(mgr.KvLen(2), 4);
  ASSERT_TRUE(mgr.Finish({1, 2}).ok());
  EXPECT_TRUE(mgr.Plan({2}, {2}).ok());  // a new sequence under the same id
}

TEST_F(KvManagerFailureTest, UndoKeepsASequenceThatExistedBeforeItsPlan) {
  KvManager mgr(client_.get());
  ASSERT_TRUE(mgr.Plan({7}, {0}).ok());
  ASSERT_TRUE(mgr.Has(7));
  auto plan = mgr.Plan({7, 8}, {4, 4});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_TRUE(mgr.Undo(*plan).ok());
  EXPECT_TRUE(mgr.Has(7));
  EXPECT_EQ(mgr.KvLen(7), 0);
  EXPECT_FALSE(mgr.Has(8));  // the plan undone started it
  EXPECT_TRUE(mgr.Finish({7}).ok());
  EXPECT_TRUE(Held(mgr.lease_id()).first.empty());
}

TEST_F(KvManagerFailureTest, RunRefusesALayerTheServerLacksWithoutHoldingUpTheSequences) {
  KvManager mgr(client_.get());
  ASSERT_TRUE(mgr.Plan({7}, {3}).ok());
  const auto q = RandomHalves(gen_, geo_.dtype, 3 * geo_.num_qo_heads * geo_.head_dim);
  const auto k = RandomHalves(gen_, geo_.dtype, 3 * geo_.RowElems());
  for (int32_t layer : {geo_.num_layers, -1}) {
    auto out = mgr.Run(layer, q, k, k);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    EXPECT_THAT(out.status().message(),
                HasSubstr(absl::StrCat("layer=", layer, " is outside [0, ", geo_.num_layers,
                                       ") (the server's num_layers)")));
  }
  EXPECT_TRUE(mgr.CheckWritten({7}).ok());
  EXPECT_TRUE(RunAll(mgr, 3).ok());
  EXPECT_TRUE(mgr.Plan({7}, {1}).ok());
}

TEST_F(KvManagerFailureTest, AReleaseThatReachesNoServerLeavesNothingPastTheTtl) {
  KvManagerOptions options;
  options.lease_ttl_ms = 1000;
  KvManager mgr(client_.get(), options);
  ASSERT_TRUE(mgr.Plan({1, 2}, {8, 8}).ok());
  ASSERT_TRUE(RunAll(mgr, 16).ok());
  faults_->SetDown(server_->grpc_address(), true);  // the release reaches nothing
  EXPECT_EQ(mgr.Release().code(), absl::StatusCode::kUnavailable);
  faults_->SetDown(server_->grpc_address(), false);
  EXPECT_TRUE(mgr.Sequences().empty());
  // No renewal any more: the server releases it all once the ttl has passed
  // (polled for up to 10 s; it takes the ttl, 1 s, and the reaper's 100 ms).
  absl::StatusOr<v1::ListHoldingsResponse> listed = admin_->ListHoldings(0);
  for (int i = 0; i < 200 && listed.ok() && listed->leases_size() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    listed = admin_->ListHoldings(0);
  }
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->leases_size(), 0);
  EXPECT_EQ(listed->unleased().page_ids_size(), 0);
}

TEST_F(KvManagerFailureTest, DestroyingTheManagerRevokesItsLease) {
  uint64_t lease = 0;
  {
    KvManager mgr(client_.get());
    ASSERT_TRUE(mgr.Plan({1, 2}, {8, 8}).ok());
    lease = mgr.lease_id();
    EXPECT_EQ(Held(lease).first.size(), 4u);
  }
  auto held = admin_->ListHoldings(0);
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(held->leases_size(), 0);
  EXPECT_EQ(held->unleased().page_ids_size(), 0);
}

}  // namespace
}  // namespace attnserve
