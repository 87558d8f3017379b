// cluster_decode_bench: decode load from C++ clients over a cluster of
// attnserve servers (client/cluster.h), part (b) of bench/run_cluster_gpu.sh.
//
//   cluster_decode_bench --targets=127.0.0.1:50051,127.0.0.1:50052 --clients=32 --batch=128 \
//       --kv_len=4096 --warmup_s=3 --duration_s=12 --json=two.json
//
// Each of --clients threads has its own Cluster (not thread-safe) over
// --targets and --batch sequences of its own, placed by the cluster (the
// server with the most free pages, as that client sees them). Set-up, not
// timed: Plan() of the first --kv_len - 1 tokens of every sequence (pages
// allocated where the cluster placed them), those keys and values written
// with WriteKV through each server's client (random rows), then Plan() of
// one decode step: one new token per sequence, key --kv_len.
//
// Timed: every client runs that same step again and again on --layer. One
// request is one Cluster::Run of one layer for the client's whole batch: one
// Prefill per server holding some of its sequences, all in flight at once,
// outputs gathered in the client's order. Each Run appends the step's K/V to
// the same slots (the same rows every time), so every request reads exactly
// --kv_len keys per sequence and the cache does not grow. (The Python
// clients of bench/cluster_bench.py plan a new step per request instead: one
// more key per sequence each time, and plan() in the request's latency.)
// With --server_plans=false (the default, as cluster_bench.py) each Prefill
// carries the step's layout; true registers it once with CreatePlan.
//
// K and V rows are drawn from a pool of kPoolRows random rows per client
// (each position picks one at random), so that the set-up of 32 x 128 x 4k
// keys does not spend minutes in the random number generator. The queries are
// fully random. --verify compares every response with the float64 reference
// (common/reference.h) over the whole sequence, so a sequence routed to the
// wrong server or rows put back in the wrong order fail the run.
//
// Exit code 0 only when the set-up and every request succeeded (and, with
// --verify, every result was right); 2 for a bad flag.
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/bench_stats.h"
#include "client/cluster.h"
#include "client/workload.h"
#include "common/reference.h"
#include "common/usage.h"

ABSL_FLAG(std::string, targets, "",
          "the servers: HOST:PORT,HOST:PORT,... (one or more), or one dns:///NAME:PORT");
ABSL_FLAG(int32_t, clients, 32, "client threads, each with its own Cluster and sequences");
ABSL_FLAG(int32_t, batch, 128, "sequences per client, all in every request of that client");
ABSL_FLAG(int32_t, kv_len, 4096,
          "keys per sequence that every request reads: --kv_len - 1 written once, plus the "
          "decode step's token");
ABSL_FLAG(int32_t, layer, 0, "layer the requests run");
ABSL_FLAG(double, warmup_s, 2, "seconds of requests before the timed window (not counted)");
ABSL_FLAG(double, duration_s, 10, "seconds of the timed window");
ABSL_FLAG(bool, server_plans, false,
          "register the decode step's layout once with CreatePlan; false: every Prefill carries "
          "it (as bench/cluster_bench.py)");
ABSL_FLAG(bool, verify, false,
          "check every response against the float64 reference (costs client CPU: not for "
          "timing)");
ABSL_FLAG(std::string, metrics, "",
          "HOST:PORT of each server's /metrics, in --targets order: per-server batches, kernel "
          "time and queue wait over the timed window");
ABSL_FLAG(std::string, json, "", "also write the results as JSON to this path");
ABSL_FLAG(uint64_t, seed, 1, "random seed");
ABSL_FLAG(double, timeout_s, 60, "per-call deadline in seconds");
ABSL_FLAG(std::string, token, "", "bearer token (also $ATTNSERVE_TOKEN)");

namespace attnserve {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kVariants = 2;               // queries per client, used in turn
constexpr int64_t kPoolRows = 4096;        // random K (and V) rows per client
constexpr int64_t kWriteBytes = 16 << 20;  // K + V bytes per WriteKV at most

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// The reference's view of a client's keys: sequence b's position p is the
// virtual slot b * kv_len + p (page_size 1), whose K and V are pool rows.
class PoolRows final : public reference::KvRows {
 public:
  PoolRows(const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
           const std::vector<int32_t>& rows, int64_t row_elems)
      : k_(k), v_(v), rows_(rows), row_elems_(row_elems) {}
  const void* K(int32_t, int64_t slot) const override {
    return k_.data() + rows_[slot] * row_elems_;
  }
  const void* V(int32_t, int64_t slot) const override {
    return v_.data() + rows_[slot] * row_elems_;
  }

 private:
  const std::vector<uint16_t>& k_;
  const std::vector<uint16_t>& v_;
  const std::vector<int32_t>& rows_;
  const int64_t row_elems_;
};

// One client thread: its Cluster, sequences, decode step and queries.
class DecodeClient {
 public:
  absl::Status SetUp(const ClusterOptions& options, int32_t index, uint64_t seed, bool verify,
                     int reference_threads) {
    batch_ = absl::GetFlag(FLAGS_batch);
    kv_len_ = absl::GetFlag(FLAGS_kv_len);
    layer_ = absl::GetFlag(FLAGS_layer);
    auto cluster = Cluster::Connect(options);
    if (!cluster.ok()) return cluster.status();
    cluster_ = *std::move(cluster);
    const KvGeometry& g = cluster_->geometry();
    const int64_t row = g.RowElems();
    std::mt19937_64 gen(seed);
    pool_k_ = RandomHalves(gen, g.dtype, kPoolRows * row);
    pool_v_ = RandomHalves(gen, g.dtype, kPoolRows * row);
    std::uniform_int_distribution<int32_t> pick(0, kPoolRows - 1);
    rows_.resize(int64_t{batch_} * kv_len_);
    for (int32_t& r : rows_) r = pick(gen);
    for (int32_t b = 0; b < batch_; ++b) ids_.push_back(int64_t{index} * batch_ + b);

    // The prompts: placed and paged by Plan, their K/V written directly.
    if (kv_len_ > 1) {
      auto prompt = cluster_->Plan(ids_, std::vector<int32_t>(batch_, kv_len_ - 1));
      if (!prompt.ok()) return Annotate(prompt.status(), "planning the prompts");
      absl::Status s = WritePrompts();
      if (!s.ok()) return Annotate(s, "writing the prompts' K/V");
    }
    // The decode step every request runs: key kv_len - 1 of each sequence.
    auto step = cluster_->Plan(ids_, std::vector<int32_t>(batch_, 1));
    if (!step.ok()) return Annotate(step.status(), "planning the decode step");
    step_ = *std::move(step);
    for (int32_t b = 0; b < batch_; ++b) {
      const int32_t r = rows_[int64_t{b} * kv_len_ + kv_len_ - 1];
      k_new_.insert(k_new_.end(), pool_k_.begin() + r * row, pool_k_.begin() + (r + 1) * row);
      v_new_.insert(v_new_.end(), pool_v_.begin() + r * row, pool_v_.begin() + (r + 1) * row);
    }
    const int64_t q_values = int64_t{batch_} * g.num_qo_heads * g.head_dim;
    for (int v = 0; v < kVariants; ++v) q_.push_back(RandomHalves(gen, g.dtype, q_values));
    if (verify) {
      KvGeometry ref_geo = g;
      ref_geo.page_size = 1;
      std::vector<int32_t> slots(rows_.size());
      for (size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<int32_t>(i);
      std::vector<reference::Seq> seqs(batch_);
      for (int32_t b = 0; b < batch_; ++b) {
        seqs[b].q_start = b;
        seqs[b].q_len = 1;
        seqs[b].kv_start = int64_t{b} * kv_len_;
        seqs[b].kv_len = kv_len_;
        seqs[b].layer = layer_;
        seqs[b].sm_scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim));
      }
      const PoolRows kv(pool_k_, pool_v_, rows_, row);
      o_ref_.resize(kVariants);
      lse_ref_.resize(kVariants);
      for (int v = 0; v < kVariants; ++v) {
        reference::Prefill(ref_geo, kv, q_[v].data(), batch_, slots, seqs, &o_ref_[v],
                           &lse_ref_[v], reference_threads);
      }
    }
    return absl::OkStatus();
  }

  // Requests back to back from `start` until `end`; those that start in
  // [timed_from, end) are recorded in `stats`.
  void Loop(Clock::time_point start, Clock::time_point timed_from, Clock::time_point end,
            bool verify, LatencyStats* stats) {
    const KvGeometry& g = cluster_->geometry();
    const double flops = 4.0 * g.head_dim * g.num_qo_heads * static_cast<double>(kv_len_) * batch_;
    std::this_thread::sleep_until(start);
    for (int64_t n = 0;; ++n) {
      const Clock::time_point t0 = Clock::now();
      if (t0 >= end) break;
      const int v = static_cast<int>(n % kVariants);
      absl::StatusOr<PrefillResult> r = cluster_->Run(layer_, q_[v], k_new_, v_new_, step_.get());
      const double latency = Seconds(Clock::now() - t0);
      bool wrong = false;
      if (r.ok() && verify) {
        const Comparison c = Compare(g.dtype, o_ref_[v], lse_ref_[v], r->o, r->lse);
        wrong = !c.Ok(g.dtype);
        if (wrong && wrong_reported_++ == 0) {
          std::cerr << absl::StrCat("wrong result (client of sequences ", ids_.front(), "..",
                                    ids_.back(), "): ", c.ToString(), "\n");
        }
      }
      if (!r.ok() && failures_++ == 0) {
        std::cerr << absl::StrCat("request failed: ", r.status().ToString(), "\n");
      }
      if (t0 >= timed_from) {
        stats->Record(latency, r.status(), wrong, batch_, flops);
        if (r.ok()) ++timed_ok_;
      } else if (!r.ok() || wrong) {
        ++warmup_errors_;
      }
    }
  }

  absl::Status TearDown() { return cluster_ == nullptr ? absl::OkStatus() : cluster_->Release(); }

  Cluster* cluster() { return cluster_.get(); }
  const ClusterStep& step() const { return *step_; }
  const std::vector<int64_t>& ids() const { return ids_; }
  int64_t timed_ok() const { return timed_ok_; }
  int64_t warmup_errors() const { return warmup_errors_; }

 private:
  static absl::Status Annotate(const absl::Status& s, absl::string_view what) {
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  }

  // Keys [0, kv_len - 1) of every sequence, on the servers that hold them,
  // in WriteKVs of at most kWriteBytes.
  absl::Status WritePrompts() {
    const KvGeometry& g = cluster_->geometry();
    const int64_t row = g.RowElems();
    const int64_t ps = g.page_size;
    const size_t chunk = std::max<int64_t>(1, kWriteBytes / (2 * row * KvDTypeBytes(g.dtype)));
    for (int32_t srv = 0; srv < cluster_->num_servers(); ++srv) {
      std::vector<int64_t> slots;
      std::vector<uint16_t> k, v;
      auto flush = [&]() -> absl::Status {
        if (slots.empty()) return absl::OkStatus();
        absl::Status s = cluster_->client(srv)->WriteKV(layer_, slots, k, v);
        slots.clear(), k.clear(), v.clear();
        return s;
      };
      for (int32_t b = 0; b < batch_; ++b) {
        for (const Shard& sh : cluster_->ShardsOf(ids_[b])) {
          if (sh.server != srv) continue;
          // The server's KvManager holds this shard's positions from its first page on.
          const std::vector<int32_t> pages = cluster_->kv_manager(srv)->PagesOf(ids_[b]);
          for (int64_t p = sh.start; p < sh.start + sh.length; ++p) {
            const int64_t i = p - sh.start;
            slots.push_back(int64_t{pages[i / ps]} * ps + i % ps);
            const int32_t r = rows_[int64_t{b} * kv_len_ + p];
            k.insert(k.end(), pool_k_.begin() + r * row, pool_k_.begin() + (r + 1) * row);
            v.insert(v.end(), pool_v_.begin() + r * row, pool_v_.begin() + (r + 1) * row);
            if (slots.size() == chunk) {
              absl::Status s = flush();
              if (!s.ok()) return s;
            }
          }
        }
      }
      absl::Status s = flush();
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  int32_t batch_ = 0, kv_len_ = 0, layer_ = 0;
  std::unique_ptr<Cluster> cluster_;
  std::vector<int64_t> ids_;                 // [batch]
  std::vector<uint16_t> pool_k_, pool_v_;    // (kPoolRows, kv_heads, head_dim) each
  std::vector<int32_t> rows_;                // (batch, kv_len): each position's pool row
  std::shared_ptr<const ClusterStep> step_;  // the decode step
  std::vector<uint16_t> k_new_, v_new_;      // (batch, kv_heads, head_dim): its new K/V
  std::vector<std::vector<uint16_t>> q_;     // kVariants x (batch, qo_heads, head_dim)
  std::vector<std::vector<double>> o_ref_, lse_ref_;  // --verify: kVariants each
  int64_t timed_ok_ = 0, warmup_errors_ = 0;
  int64_t failures_ = 0, wrong_reported_ = 0;
};

// One server's counters from /metrics.
struct ServerCounters {
  double prefills = 0, prefill_seconds = 0;  // Prefill RPCs finished, their server time
  double batches = 0, batch_requests = 0;    // attention launches, requests in them
  double kernel_seconds = 0;                 // every kernel, device time on CUDA
  double waits = 0, wait_seconds = 0;        // queue waits
};

absl::StatusOr<ServerCounters> ReadCounters(const std::string& address) {
  auto text = FetchMetrics(address);
  if (!text.ok()) return text.status();
  // A series not there yet (nothing observed) counts 0.
  auto sum = [&](absl::string_view name, absl::string_view label = "",
                 absl::string_view exclude = "") {
    return SumMetric(*text, name, label, exclude).value_or(0.0);
  };
  ServerCounters c;
  c.prefills = sum("attnserve_request_duration_seconds_count", "method=\"Prefill\"");
  c.prefill_seconds = sum("attnserve_request_duration_seconds_sum", "method=\"Prefill\"");
  c.batches = sum("attnserve_batch_requests_count");
  c.batch_requests = sum("attnserve_batch_requests_sum");
  c.kernel_seconds = sum("attnserve_kernel_duration_seconds_sum");  // kernels are disjoint
  c.waits = sum("attnserve_queue_wait_seconds_count");
  c.wait_seconds = sum("attnserve_queue_wait_seconds_sum");
  return c;
}

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::vector<std::string> SplitList(const std::string& flag) {
  if (flag.empty()) return {};
  return absl::StrSplit(flag, ',');
}

int Main() {
  const std::vector<std::string> targets = SplitList(absl::GetFlag(FLAGS_targets));
  const std::vector<std::string> metrics = SplitList(absl::GetFlag(FLAGS_metrics));
  const int32_t clients = absl::GetFlag(FLAGS_clients);
  const int32_t batch = absl::GetFlag(FLAGS_batch);
  const int32_t kv_len = absl::GetFlag(FLAGS_kv_len);
  const int32_t layer = absl::GetFlag(FLAGS_layer);
  const double warmup_s = absl::GetFlag(FLAGS_warmup_s);
  const double duration_s = absl::GetFlag(FLAGS_duration_s);
  const bool verify = absl::GetFlag(FLAGS_verify);
  std::vector<std::string> bad;
  if (targets.empty()) bad.push_back("--targets is empty: give HOST:PORT,HOST:PORT,...");
  for (const std::string& t : targets) {
    if (t.empty()) bad.push_back("--targets has an empty entry");
  }
  for (const std::string& m : metrics) {
    if (m.empty()) bad.push_back("--metrics has an empty entry");
  }
  if (clients < 1) bad.push_back(absl::StrCat("--clients=", clients, " must be >= 1"));
  if (batch < 1) bad.push_back(absl::StrCat("--batch=", batch, " must be >= 1"));
  if (kv_len < 1) bad.push_back(absl::StrCat("--kv_len=", kv_len, " must be >= 1"));
  if (batch >= 1 && kv_len >= 1 && int64_t{batch} * kv_len > (int64_t{1} << 31) - 1) {
    bad.push_back(absl::StrCat("--batch x --kv_len = ", int64_t{batch} * kv_len,
                               " keys per client must be < 2^31"));
  }
  if (layer < 0) bad.push_back(absl::StrCat("--layer=", layer, " must be >= 0"));
  // (At most 1e7 s: the run's time points stay far from overflowing.)
  if (!(warmup_s >= 0 && warmup_s <= 1e7)) {
    bad.push_back(absl::StrCat("--warmup_s=", warmup_s, " must be in [0, 1e7]"));
  }
  if (!(duration_s > 0 && duration_s <= 1e7)) {
    bad.push_back(absl::StrCat("--duration_s=", duration_s, " must be in (0, 1e7]"));
  }
  if (!(absl::GetFlag(FLAGS_timeout_s) > 0)) {
    bad.push_back(absl::StrCat("--timeout_s=", absl::GetFlag(FLAGS_timeout_s), " must be > 0"));
  }
  if (!bad.empty()) {
    std::cerr << "error: " << absl::StrJoin(bad, "; ") << "\n";
    return 2;
  }

  ClusterOptions options;
  options.targets = targets;
  options.client.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  options.client.token = absl::GetFlag(FLAGS_token);
  if (options.client.token.empty() && std::getenv("ATTNSERVE_TOKEN") != nullptr) {
    options.client.token = std::getenv("ATTNSERVE_TOKEN");
  }
  options.kv.server_plans = absl::GetFlag(FLAGS_server_plans);

  // The servers as one cluster sees them: geometry, free pages.
  std::vector<ClusterServer> servers;
  KvGeometry geo;
  v1::ServerInfo info;
  {
    auto probe = Cluster::Connect(options);
    if (!probe.ok()) {
      std::cerr << "error: " << probe.status() << "\n";
      return 1;
    }
    servers = (*probe)->Servers();
    geo = (*probe)->geometry();
    info = (*probe)->client(0)->info();
  }
  const int32_t num_servers = static_cast<int32_t>(servers.size());
  if (layer >= geo.num_layers) {
    std::cerr << "error: --layer=" << layer << " must be < the servers' num_layers ("
              << geo.num_layers << ")\n";
    return 2;
  }
  if (!metrics.empty() && static_cast<int32_t>(metrics.size()) != num_servers) {
    std::cerr << "error: --metrics has " << metrics.size() << " addresses but the cluster has "
              << num_servers << " servers: give one per server, in --targets order\n";
    return 2;
  }
  // Every client holds its sequences for the whole run: say so before
  // allocating when they cannot fit.
  const int64_t pages_per_seq = (kv_len + geo.page_size - 1) / geo.page_size;
  const int64_t need = int64_t{clients} * batch * pages_per_seq;
  int64_t free_pages = 0;
  std::vector<std::string> per_server_free;
  for (const ClusterServer& s : servers) {
    free_pages += s.free_pages;
    per_server_free.push_back(absl::StrCat(s.address, " ", s.free_pages));
  }
  if (need > free_pages) {
    std::cerr << absl::StrFormat(
        "error: --clients=%d x --batch=%d sequences x %d KV pages (--kv_len=%d, page_size %d) = "
        "%d pages, but the servers have %d free (%s): lower --clients, --batch or --kv_len, or "
        "start the servers with more --num_pages\n",
        clients, batch, pages_per_seq, kv_len, geo.page_size, need, free_pages,
        absl::StrJoin(per_server_free, ", "));
    return 1;
  }

  // Set-up, every client at once: connect, place, write, plan the step.
  const int reference_threads =
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / clients);
  std::vector<DecodeClient> workers(clients);
  std::vector<absl::Status> setup(clients);
  const Clock::time_point setup_start = Clock::now();
  {
    std::vector<std::thread> threads;
    for (int32_t i = 0; i < clients; ++i) {
      threads.emplace_back([&, i] {
        setup[i] = workers[i].SetUp(options, i, absl::GetFlag(FLAGS_seed) * 1000003 + i, verify,
                                    reference_threads);
      });
    }
    for (auto& t : threads) t.join();
  }
  const double setup_s = Seconds(Clock::now() - setup_start);
  auto tear_down = [&] {
    std::vector<std::thread> threads;
    for (DecodeClient& w : workers) {
      DecodeClient* client = &w;
      threads.emplace_back([client] {
        absl::Status s = client->TearDown();
        if (!s.ok()) std::cerr << "release: " << s << "\n";
      });
    }
    for (auto& t : threads) t.join();
  };
  for (int32_t i = 0; i < clients; ++i) {
    if (!setup[i].ok()) {
      std::cerr << "error: set-up of client " << i << ": " << setup[i] << "\n";
      tear_down();
      return 1;
    }
  }

  // Where the sequences went, and what each request sends to each server.
  std::vector<int64_t> sequences(num_servers, 0);
  std::vector<int64_t> rows_per_request(num_servers, 0);  // summed over clients
  int64_t spread = 0, kv_len_at_end = 0;
  for (DecodeClient& w : workers) {
    for (int64_t id : w.ids()) {
      const std::vector<Shard> shards = w.cluster()->ShardsOf(id);
      if (shards.size() > 1) ++spread;
      for (const Shard& sh : shards) ++sequences[sh.server];
    }
  }

  // The timed run: every client starts together.
  LatencyStats stats;
  const Clock::time_point start = Clock::now() + std::chrono::milliseconds(100);
  const Clock::time_point timed_from =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(warmup_s));
  const Clock::time_point end =
      timed_from +
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(duration_s));
  std::vector<std::thread> threads;
  for (DecodeClient& w : workers) {
    DecodeClient* client = &w;
    threads.emplace_back([&, client] { client->Loop(start, timed_from, end, verify, &stats); });
  }
  std::vector<std::optional<ServerCounters>> before(num_servers), after(num_servers);
  std::vector<std::string> metrics_notes(num_servers);
  auto read_all = [&](std::vector<std::optional<ServerCounters>>* out) {
    for (size_t i = 0; i < metrics.size(); ++i) {
      auto c = ReadCounters(metrics[i]);
      if (c.ok()) {
        (*out)[i] = *c;
      } else {
        metrics_notes[i] = c.status().ToString();
      }
    }
  };
  std::this_thread::sleep_until(timed_from);
  const double cpu_before = CpuSeconds();
  read_all(&before);
  std::this_thread::sleep_until(end);
  const double cpu_s = CpuSeconds() - cpu_before;
  read_all(&after);
  for (auto& t : threads) t.join();

  int64_t warmup_errors = 0;
  std::vector<double> rpcs_per_s(num_servers, 0), rows_per_s(num_servers, 0);
  for (DecodeClient& w : workers) {
    warmup_errors += w.warmup_errors();
    for (const ClusterStep::Part& part : w.step().parts) {
      rows_per_request[part.server] += static_cast<int64_t>(part.q_rows.size());
      rpcs_per_s[part.server] += w.timed_ok() / duration_s;
      rows_per_s[part.server] +=
          w.timed_ok() * static_cast<double>(part.q_rows.size()) / duration_s;
    }
    for (int64_t id : w.ids()) kv_len_at_end = std::max(kv_len_at_end, w.cluster()->KvLen(id));
  }
  tear_down();

  // Report.
  const LatencyStats::Snapshot s = stats.Take(false);
  const double rps = s.ok / duration_s;
  double rpcs = 0;
  for (double x : rpcs_per_s) rpcs += x;
  std::vector<std::string> codes;
  for (const auto& [code, count] : s.errors) codes.push_back(absl::StrCat(code, "=", count));
  if (s.wrong > 0) codes.push_back(absl::StrCat("WRONG_RESULT=", s.wrong));
  if (warmup_errors > 0) codes.push_back(absl::StrCat("in the warmup=", warmup_errors));
  const int64_t total_seqs = int64_t{clients} * batch;
  std::cout << absl::StrFormat(
      "cluster_decode_bench: %d server%s, %d clients x %d sequences over %d keys (one query row "
      "each), layer %d, %s\n"
      "servers:    %s backend, %d qo heads, %d kv heads, head_dim %d, page_size %d, %s\n"
      "set-up:     %.1f s (%d sequences placed and written; %d spread over servers; keys per "
      "sequence at the end %d)\n"
      "timed:      %.1f s after %.1f s of warmup: %d requests, %d OK%s\n"
      "throughput: %.1f requests/s, %.1f Prefill RPCs/s, %.1f sequences/s, %.4g TFLOP/s\n"
      "latency ms: p50 %s  p90 %s  p99 %s  max %s\n"
      "client:     %.3f ms of process CPU per request (%.1f cores busy)\n"
      "errors:     %s\n",
      num_servers, num_servers == 1 ? "" : "s", clients, batch, kv_len, layer,
      options.kv.server_plans ? "layout registered once (CreatePlan)"
                              : "layout sent with every Prefill",
      info.backend(), geo.num_qo_heads, geo.num_kv_heads, geo.head_dim, geo.page_size,
      v1::DType_Name(info.kv_dtype()), setup_s, total_seqs, spread, kv_len_at_end, duration_s,
      warmup_s, s.done, s.ok, verify ? ", every response verified" : "", rps, rpcs,
      s.rows / duration_s, s.flops / duration_s / 1e12, FormatMs(s.Percentile(50)),
      FormatMs(s.Percentile(90)), FormatMs(s.Percentile(99)), FormatMs(s.Percentile(100)),
      s.ok > 0 ? 1e3 * cpu_s / s.ok : 0.0, cpu_s / duration_s,
      codes.empty() ? "none" : absl::StrJoin(codes, " "));

  std::vector<std::string> json_servers;
  for (int32_t i = 0; i < num_servers; ++i) {
    const double share = total_seqs > 0 ? static_cast<double>(sequences[i]) / total_seqs : 0;
    std::cout << absl::StrFormat(
        "server %d %s: %d sequences (%.1f%%), %.1f Prefill RPCs/s, %.1f query rows/s", i,
        servers[i].address, sequences[i], 100 * share, rpcs_per_s[i], rows_per_s[i]);
    std::string json_metrics = "null";
    if (i < static_cast<int32_t>(metrics.size())) {
      if (before[i] && after[i]) {
        const ServerCounters& b = *before[i];
        const ServerCounters& e = *after[i];
        const double prefills = e.prefills - b.prefills;
        const double batches = e.batches - b.batches;
        const double waits = e.waits - b.waits;
        const double kernel = e.kernel_seconds - b.kernel_seconds;
        const double per_batch = batches > 0 ? (e.batch_requests - b.batch_requests) / batches : 0;
        const double kernel_ms = batches > 0 ? 1e3 * kernel / batches : 0;
        const double wait_ms = waits > 0 ? 1e3 * (e.wait_seconds - b.wait_seconds) / waits : 0;
        const double server_ms =
            prefills > 0 ? 1e3 * (e.prefill_seconds - b.prefill_seconds) / prefills : 0;
        std::cout << absl::StrFormat(
            "; /metrics: %.1f Prefills/s in %.1f batches/s (%.1f requests each), kernels %.3f "
            "ms/batch, device busy %.1f%%, queue wait %.3f ms, %.3f ms in the server per Prefill",
            prefills / duration_s, batches / duration_s, per_batch, kernel_ms,
            100 * kernel / duration_s, wait_ms, server_ms);
        json_metrics = absl::StrFormat(
            "{\"prefills_per_s\": %.6g, \"batches_per_s\": %.6g, \"requests_per_batch\": %.6g, "
            "\"kernel_ms_per_batch\": %.6g, \"device_busy\": %.6g, \"queue_wait_ms\": %.6g, "
            "\"server_ms_per_prefill\": %.6g}",
            prefills / duration_s, batches / duration_s, per_batch, kernel_ms,
            kernel / duration_s, wait_ms, server_ms);
      } else {
        std::cout << "; /metrics not read (" << metrics_notes[i] << ")";
      }
    }
    std::cout << "\n";
    json_servers.push_back(absl::StrFormat(
        "{\"address\": %s, \"sequences\": %d, \"sequence_share\": %.6g, "
        "\"rows_per_request\": %d, \"prefill_rpcs_per_s\": %.6g, \"query_rows_per_s\": %.6g, "
        "\"metrics\": %s}",
        JsonString(servers[i].address), sequences[i], share, rows_per_request[i], rpcs_per_s[i],
        rows_per_s[i], json_metrics));
  }

  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::vector<std::string> errors, json_targets;
    for (const auto& [code, count] : s.errors) {
      errors.push_back(absl::StrFormat("%s: %d", JsonString(code), count));
    }
    for (const std::string& t : targets) json_targets.push_back(JsonString(t));
    std::ofstream f(path);
    f << absl::StrFormat(
        "{\n  \"bench\": \"cluster_decode_bench\", \"targets\": [%s], \"servers\": %d,\n"
        "  \"clients\": %d, \"batch\": %d, \"kv_len\": %d, \"layer\": %d, \"server_plans\": %s,\n"
        "  \"verify\": %s, \"warmup_s\": %.6g, \"duration_s\": %.6g, \"setup_s\": %.6g,\n"
        "  \"backend\": %s, \"num_qo_heads\": %d, \"num_kv_heads\": %d, \"head_dim\": %d,\n"
        "  \"page_size\": %d, \"kv_dtype\": %s,\n"
        "  \"requests\": %d, \"ok\": %d, \"requests_per_s\": %.6g, \"prefill_rpcs_per_s\": %.6g,\n"
        "  \"sequences_per_s\": %.6g, \"tflops\": %.6g,\n"
        "  \"latency_ms\": {\"p50\": %s, \"p90\": %s, \"p99\": %s, \"max\": %s},\n"
        "  \"errors\": %d, \"errors_by_code\": {%s}, \"wrong_results\": %d, "
        "\"warmup_errors\": %d,\n"
        "  \"kv_len_at_end\": %d, \"spread_sequences\": %d,\n"
        "  \"client_cpu_ms_per_request\": %.6g, \"client_cpu_cores\": %.6g,\n"
        "  \"per_server\": [\n    %s\n  ]\n}\n",
        absl::StrJoin(json_targets, ", "), num_servers, clients, batch, kv_len, layer,
        options.kv.server_plans ? "true" : "false", verify ? "true" : "false", warmup_s,
        duration_s, setup_s, JsonString(info.backend()), geo.num_qo_heads, geo.num_kv_heads,
        geo.head_dim, geo.page_size, JsonString(v1::DType_Name(info.kv_dtype())), s.done, s.ok,
        rps, rpcs, s.rows / duration_s, s.flops / duration_s / 1e12, FormatMs(s.Percentile(50)),
        FormatMs(s.Percentile(90)), FormatMs(s.Percentile(99)), FormatMs(s.Percentile(100)),
        s.Errors(), absl::StrJoin(errors, ", "), s.wrong, warmup_errors, kv_len_at_end, spread,
        s.ok > 0 ? 1e3 * cpu_s / s.ok : 0.0, cpu_s / duration_s,
        absl::StrJoin(json_servers, ",\n    "));
    if (!f.good()) {
      std::cerr << "error: cannot write " << path << "\n";
      return 1;
    }
  }
  return s.Errors() == 0 && warmup_errors == 0 && s.ok > 0 ? 0 : 1;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  attnserve::ParseCommandLine(
      argc, argv,
      {"cluster_decode_bench",
       "cluster_decode_bench --targets=HOST:PORT,... [flags]: decode load from C++ clients over\n"
       "one or more attnserve servers through the cluster client (client/cluster.h). Each of\n"
       "--clients threads has its own Cluster and --batch sequences, placed by the cluster; their\n"
       "first --kv_len - 1 keys are written once (WriteKV, random rows), then one decode step\n"
       "(one new token per sequence) is planned once and run again and again: a request is one\n"
       "Run of one layer for the client's whole batch (one Prefill per server holding some of its\n"
       "sequences), each reads exactly --kv_len keys per sequence, and the cache does not grow.\n"
       "(bench/cluster_bench.py's Python clients plan a new step per request: one more key each\n"
       "time.) Requests/s, latency and each server's share over --duration_s after --warmup_s;\n"
       "--verify checks every response against the float64 reference.",
       {{"bench/cluster_decode_bench.cc", "Flags"}}});
  return attnserve::Main();
}
