// attnbench: load generator for a running attnserve.
//
//   attnbench --workload=decode --batch=64 --kv_len=4096 --concurrency=16 --duration_s=30
//   attnbench --workload=prefill --batch=1 --q_len=16384 --requests=20 --json=out.json
//   attnbench --workload=decode --rate=500 --concurrency=64 --metrics=127.0.0.1:9464
//   attnbench --workload=prefix --window_left=128 --soft_cap=50 --sinks=random --verify
//
// Closed loop (default): --concurrency clients, each with its own Client and
// channel, send back to back. Open loop (--rate=R): Poisson arrivals at R
// requests/s, served by --concurrency clients; an arrival that finds
// --concurrency requests already outstanding is dropped and counted, and a
// request's latency runs from its scheduled arrival.
//
// Each client allocates its pages and writes random K/V once (keeping a copy
// in a KvMirror); the timed loop only sends Prefill. --window_left, --soft_cap
// and --sinks (client/cli_flags.h) give every request those attention options
// (with --plan, the plans carry them); the TFLOP/s count only the (query, key)
// pairs a window lets through. --verify compares every response with the
// float64 reference. Exit code 0 only when no request failed
// and (with --verify) none was wrong.
//
// --shm: each client registers a system region, a sealed memfd (the server
// needs --allow_shared_memory and must share the host) and its requests name it
// for q, the output and the LSE instead of carrying them (docs/transport.md).
// The query is written into the region before the clock starts, as an
// engine that computes it there would have it; the latency is the Prefill
// call alone.
//
// --channel (with --shm): each client opens a request channel in its region
// (client/channel.h) and sends its requests through it instead of a gRPC
// call each: the ring at the region's start, the tensors after it. With
// --busy_poll the caller spins on its slot for the whole wait.
//
// --cuda_device=N (with --shm): q, the output and the LSE live in device
// memory on GPU N of this process, registered as a CUDA region (client/
// cuda_memory.h), so the server copies them device to device (over NVLink
// when it runs on another GPU); the system region then holds only the
// --channel ring. Needs a build with the CUDA toolkit.
//
// --plan: each client registers every request shape's layout once
// (CreatePlan) and its requests name the plan instead of carrying the
// layout, as an engine's per-layer requests of one step do (docs/design.md,
// Plans): the request carries the query (or its region) and a plan id.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/bench_stats.h"
#include "client/bench_worker.h"
#include "client/cli_flags.h"
#include "client/client.h"
#include "common/host_port.h"
#include "common/transport.h"
#include "common/usage.h"

ABSL_FLAG(std::string, workload, "decode", "decode | prefill | prefix | mixed");
ABSL_FLAG(int32_t, batch, 1, "sequences per request");
ABSL_FLAG(int32_t, q_len, 128, "prefill/prefix: query rows per sequence");
ABSL_FLAG(int32_t, kv_len, 1024, "decode/prefix: keys per sequence");
ABSL_FLAG(int32_t, layer, 0, "layer the requests read");
ABSL_FLAG(int32_t, concurrency, 1,
          "clients (closed loop); most requests outstanding at once (open loop)");
ABSL_FLAG(double, rate, 0, "open loop: target requests/s with Poisson arrivals; 0: closed loop");
ABSL_FLAG(double, duration_s, 0,
          "run for this long (seconds); 0: until --requests, or 10 s without --requests");
ABSL_FLAG(int64_t, requests, 0, "stop after this many requests (0: only --duration_s)");
ABSL_FLAG(bool, verify, false, "check every response against the float64 reference");
ABSL_FLAG(bool, shm, false,
          "send q and receive the output and LSE through a shared-memory region per client "
          "(server on this host with --allow_shared_memory)");
ABSL_FLAG(bool, channel, false,
          "with --shm: send the requests through a request channel in the region (no gRPC call "
          "per request; docs/transport.md)");
ABSL_FLAG(int32_t, cuda_device, -1,
          "with --shm: keep q, the output and the LSE in a CUDA region on this GPU of the client "
          "(-1: in the system region)");
ABSL_FLAG(bool, plan, false,
          "register each request shape's layout once (CreatePlan) and send its plan id, as an "
          "engine's per-layer requests within one step do");
ABSL_FLAG(bool, retain_freed_memory, true,
          "keep memory freed by malloc for the next message (common/transport.h, "
          "RetainFreedMemory), as attnserve does; false: glibc's defaults");
ABSL_FLAG(std::string, metrics, "", "HOST:PORT of the server's /metrics, for requests per launch");
ABSL_FLAG(std::string, json, "", "also write the results as JSON to this path");
ABSL_FLAG(uint64_t, seed, 1, "random seed");
ABSL_FLAG(std::string, kv_dtype, "",
          "the server's KV cache dtype this run expects (bf16, fp16, fp8_e4m3, fp8_e5m2): "
          "another one exits 1 before anything is written; empty: any");
ABSL_FLAG(double, kv_scale, 0,
          "FP8 servers: set K's and V's scale of --layer to this before writing (SetKvScales); "
          "0: keep the server's");
ABSL_FLAG(bool, fp8_rows, false,
          "FP8 servers: write the K/V rows already quantized (as the cache stores them) instead "
          "of 16-bit rows the server quantizes");

namespace attnserve {
namespace {

using Clock = BenchClock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The attnserve_batch_requests histogram's sum and count from /metrics.
absl::StatusOr<std::pair<double, double>> ScrapeBatchRequests(const std::string& address) {
  auto text = FetchMetrics(address);
  if (!text.ok()) return text.status();
  auto sum = SumMetric(*text, "attnserve_batch_requests_sum");
  auto count = SumMetric(*text, "attnserve_batch_requests_count");
  if (!sum.ok() || !count.ok()) {
    return absl::NotFoundError(absl::StrCat("no attnserve_batch_requests at ", address));
  }
  return std::make_pair(*sum, *count);
}

// Open-loop arrivals waiting for a free client.
class ArrivalQueue {
 public:
  explicit ArrivalQueue(int64_t bound) : bound_(bound) {}
  // False (dropped) when `bound` requests are already queued or in flight.
  bool Push(Clock::time_point t) {
    absl::MutexLock lock(&mu_);
    if (static_cast<int64_t>(queue_.size()) + in_flight_ >= bound_) return false;
    queue_.push_back(t);
    return true;
  }
  // Next arrival, or nullopt once closed and empty.
  std::optional<Clock::time_point> Pop() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](ArrivalQueue* q) { return !q->queue_.empty() || q->closed_; }, this));
    if (queue_.empty()) return std::nullopt;
    const Clock::time_point t = queue_.front();
    queue_.erase(queue_.begin());
    ++in_flight_;
    return t;
  }
  void Done() {
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }

 private:
  absl::Mutex mu_;
  std::vector<Clock::time_point> queue_;
  int64_t in_flight_ = 0;
  const int64_t bound_;
  bool closed_ = false;
};

std::atomic<bool> g_interrupted{false};
void OnInterrupt(int sig) {
  g_interrupted.store(true);
  std::signal(sig, SIG_DFL);
}
bool Interrupted() { return g_interrupted.load(std::memory_order_relaxed); }
// Sleeps until `t`, or until `stop` or a signal (looked at every 50 ms).
template <typename TimePoint>
void SleepUntil(TimePoint t, const std::atomic<bool>& stop) {
  while (!stop.load() && !Interrupted()) {
    const auto now = TimePoint::clock::now();
    if (now >= t) return;
    std::this_thread::sleep_until(std::min(t, now + std::chrono::milliseconds(50)));
  }
}

// The flag errors attnbench reports before it connects (exit 2).
absl::Status CheckFlags() {
  const double rate = absl::GetFlag(FLAGS_rate), duration_s = absl::GetFlag(FLAGS_duration_s);
  if (ShapesOf(absl::GetFlag(FLAGS_workload), 1, 1).empty()) {
    return absl::InvalidArgumentError("--workload must be decode, prefill, prefix or mixed");
  }
  if (absl::GetFlag(FLAGS_channel) && !absl::GetFlag(FLAGS_shm)) {
    return absl::InvalidArgumentError("--channel needs --shm (the channel's ring lives in the shm region)");
  }
  if (absl::GetFlag(FLAGS_cuda_device) >= 0 && !absl::GetFlag(FLAGS_shm)) {
    return absl::InvalidArgumentError("--cuda_device needs --shm (it moves the --shm tensors to the GPU)");
  }
  if (absl::GetFlag(FLAGS_cuda_device) < -1) {
    return absl::InvalidArgumentError("--cuda_device must be -1 (off) or a GPU index >= 0");
  }
  if (absl::GetFlag(FLAGS_concurrency) < 1 || absl::GetFlag(FLAGS_batch) < 1 || absl::GetFlag(FLAGS_q_len) < 1 ||
      absl::GetFlag(FLAGS_kv_len) < 1 || !(rate >= 0) || absl::GetFlag(FLAGS_requests) < 0 ||
      !(duration_s >= 0)) {
    return absl::InvalidArgumentError(
        "--concurrency, --batch, --q_len, --kv_len must be >= 1; --rate, --requests, --duration_s >= 0");
  }
  // Bounds that keep the run's arithmetic (its end time, page counts, the
  // request's tensors) far from overflowing.
  if (!(rate <= 1e9) || !(duration_s <= 1e7)) {
    return absl::InvalidArgumentError("--rate must be at most 1e9 requests/s and --duration_s at most 1e7 s");
  }
  if (rate > 0 && rate < 1e-3) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rate=", rate, " must be 0 (closed loop) or at least 0.001 requests/s"));
  }
  if (const std::string d = absl::GetFlag(FLAGS_kv_dtype);
      !d.empty() && d != "bf16" && d != "fp16" && d != "fp8_e4m3" && d != "fp8_e5m2") {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_dtype=", d, " must be bf16, fp16, fp8_e4m3 or fp8_e5m2 (or empty: any)"));
  }
  if (const std::string m = absl::GetFlag(FLAGS_metrics); !m.empty()) {
    const std::optional<HostPort> hp = SplitHostPort(m);
    if (!hp || hp->host.empty() || PortNumber(hp->port, 1) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--metrics=", m, " must be HOST:PORT of the server's /metrics (port in [1, 65535])"));
    }
  }
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    // Found unwritable before the run, not after it. (A file that was not
    // there is removed again: the report writes it.)
    const bool existed = access(path.c_str(), F_OK) == 0;
    std::ofstream probe(path, std::ios::app);
    if (!probe) {
      return absl::InvalidArgumentError(
          absl::StrCat("--json=", path, ": cannot be written (", std::strerror(errno), ")"));
    }
    probe.close();
    if (!existed) unlink(path.c_str());
  }
  constexpr int32_t kMaxLen = 1 << 24;
  if (absl::GetFlag(FLAGS_q_len) > kMaxLen || absl::GetFlag(FLAGS_kv_len) > kMaxLen ||
      absl::GetFlag(FLAGS_batch) > kMaxLen) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch, --q_len and --kv_len must be at most ", kMaxLen));
  }
  if (const double scale = absl::GetFlag(FLAGS_kv_scale); !(scale >= 0) || !std::isfinite(scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_scale=", scale, " must be finite and >= 0 (0: keep the server's)"));
  }
  return CheckClientFlags();
}

// The run's settings from the flags (after CheckFlags); the attention
// options are the server's to size (its query heads).
BenchConfig ConfigFromFlags() {
  BenchConfig c;
  c.workload = absl::GetFlag(FLAGS_workload);
  c.batch = absl::GetFlag(FLAGS_batch);
  c.q_len = absl::GetFlag(FLAGS_q_len);
  c.kv_len = absl::GetFlag(FLAGS_kv_len);
  c.layer = absl::GetFlag(FLAGS_layer);
  c.verify = absl::GetFlag(FLAGS_verify);
  c.shm = absl::GetFlag(FLAGS_shm);
  c.channel = absl::GetFlag(FLAGS_channel);
  c.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  c.plan = absl::GetFlag(FLAGS_plan);
  c.kv_scale = absl::GetFlag(FLAGS_kv_scale);
  c.fp8_rows = absl::GetFlag(FLAGS_fp8_rows);
  return c;
}

// Whether the run fits the server, before any client allocates: its KV
// dtype (--kv_dtype), a request's queries in a message (the output is as
// large) or, with --shm, a sane size for one client's region, and every
// client's pages free (each holds its pages for the whole run).
absl::Status CheckServer(const v1::ServerInfo& info, const BenchConfig& config,
                         const std::vector<ShapeSpec>& specs, int32_t concurrency) {
  if (const std::string want = absl::GetFlag(FLAGS_kv_dtype); !want.empty()) {
    const KvGeometry g = GeometryOf(info);
    const std::string have =
        g.KvIsFp8() ? Fp8FormatName(g.kv_fp8) : (g.dtype == KvDType::kBf16 ? "bf16" : "fp16");
    if (want != have) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--kv_dtype=", want, ", but the server's KV cache is ", have, " (its --kv_dtype)"));
    }
  }
  int32_t most_q = 1, most_keys = 0;
  for (const ShapeSpec& sp : specs) {
    most_q = std::max(most_q, sp.q_len);
    most_keys = std::max(most_keys, sp.kv_len);
  }
  const int64_t q_bytes = int64_t{config.batch} * most_q * info.num_qo_heads() * info.head_dim() * 2;
  const int64_t most = config.shm ? (int64_t{1} << 32) : info.max_message_bytes();
  if (q_bytes > most) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--batch=%d x --q_len=%d query rows a request are %d bytes of queries, more than "
        "the %d a request may carry (%s): lower --batch or --q_len",
        config.batch, most_q, q_bytes, most, config.shm ? "4 GiB a region" : "the server's max_message_bytes"));
  }
  const int64_t per_client = PagesPerClient(specs, config.batch, info.page_size());
  if (per_client * concurrency > info.free_pages()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "--concurrency=%d clients x %d KV pages each (--batch=%d sequences of up to %d "
        "keys, page_size %d, per request shape) = %d pages, but the server has %d of its %d "
        "pages free: lower --concurrency, --batch or --kv_len (--q_len for prefill), or start "
        "attnserve with more --num_pages",
        concurrency, per_client, config.batch, most_keys, info.page_size(), per_client * concurrency,
        info.free_pages(), info.num_pages()));
  }
  return absl::OkStatus();
}

// The timed run: closed loop (each client sends back to back until the
// end time or --requests), or open loop at --rate; progress on stderr once
// a second. Returns the seconds it took.
double RunTimed(std::vector<BenchWorker>& workers, LatencyStats* stats) {
  const int32_t concurrency = static_cast<int32_t>(workers.size());
  const double rate = absl::GetFlag(FLAGS_rate);
  const int64_t max_requests = absl::GetFlag(FLAGS_requests);
  const double duration_s = absl::GetFlag(FLAGS_duration_s) > 0 ? absl::GetFlag(FLAGS_duration_s)
                                                                : (max_requests > 0 ? 0 : 10);
  std::atomic<int64_t> issued{0};  // closed loop: requests claimed
  std::atomic<bool> stop{false};
  const Clock::time_point start = Clock::now();
  const Clock::time_point end = duration_s > 0
                                    ? start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(duration_s))
                                    : Clock::time_point::max();
  ArrivalQueue arrivals(concurrency);
  std::vector<std::thread> threads;
  for (int i = 0; i < concurrency; ++i) {
    threads.emplace_back([&, i] {
      BenchWorker& w = workers[i];
      if (rate > 0) {
        while (auto t = arrivals.Pop()) {
          w.SendOne(*t, stats);
          arrivals.Done();
        }
        return;
      }
      while (Clock::now() < end && !Interrupted()) {
        if (max_requests > 0 && issued.fetch_add(1) >= max_requests) break;
        w.SendOne(Clock::now(), stats);
      }
    });
  }
  std::thread arrival_thread;
  if (rate > 0) {
    arrival_thread = std::thread([&] {
      std::mt19937_64 gen(absl::GetFlag(FLAGS_seed));
      std::exponential_distribution<double> gap(rate);
      Clock::time_point t = start;
      int64_t accepted = 0;
      while (!stop.load() && !Interrupted() && (max_requests <= 0 || accepted < max_requests)) {
        // The gap in seconds first: past the end (or past what a time
        // point holds) it ends the arrivals.
        const double g = gap(gen);
        if (end != Clock::time_point::max() && !(g < std::chrono::duration<double>(end - t).count())) {
          SleepUntil(end, stop);  // the run lasts its --duration_s
          break;
        }
        if (!(g < 1e7)) break;  // (--requests alone: no end; --rate >= 0.001 makes this rare)
        t += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(g));
        SleepUntil(t, stop);
        if (Interrupted()) break;
        if (arrivals.Push(t)) {
          ++accepted;
        } else {
          stats->Dropped();
        }
      }
      arrivals.Close();
    });
  }

  // Progress once a second until every client is done.
  std::atomic<bool> finished{false};
  std::thread progress([&] {
    const bool tty = isatty(STDERR_FILENO);
    int64_t last_done = 0;
    Clock::time_point last = start;
    while (!finished.load()) {
      for (int i = 0; i < 10 && !finished.load(); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (finished.load()) break;
      const LatencyStats::Snapshot s = stats->Take(false);
      const Clock::time_point now = Clock::now();
      std::cerr << absl::StrFormat(
          "%s%6.1fs  done %d  %.1f req/s  p50 %s ms  p99 %s ms  errors %d%s", tty ? "\r" : "",
          Seconds(now - start), s.done, (s.done - last_done) / Seconds(now - last),
          FormatMs(s.Percentile(50)), FormatMs(s.Percentile(99)), s.Errors(), tty ? "  " : "\n");
      last_done = s.done;
      last = now;
    }
    if (tty) std::cerr << "\n";
  });
  for (auto& t : threads) t.join();
  const double elapsed = Seconds(Clock::now() - start);
  stop = true;
  if (arrival_thread.joinable()) arrival_thread.join();
  finished = true;
  progress.join();
  return elapsed;
}

// The report on stdout and, with --json, in that file; the run's failed
// requests and wrong results.
absl::StatusOr<int64_t> Report(const v1::ServerInfo& info, const BenchConfig& config, const LatencyStats& stats,
                               double elapsed, std::optional<double> per_launch, const std::string& metrics_note) {
  const std::string& workload = config.workload;
  const int32_t concurrency = absl::GetFlag(FLAGS_concurrency);
  const double rate = absl::GetFlag(FLAGS_rate);
  const bool verify = config.verify;
  const LatencyStats::Snapshot s = stats.Take(!absl::GetFlag(FLAGS_json).empty());
  const double rps = s.ok / elapsed, rows_ps = s.rows / elapsed, tflops = s.flops / elapsed / 1e12;
  // attnecho computes nothing: no FLOP rate for it. A decode request has
  // one query row per sequence, whatever --q_len says.
  const bool computes = info.backend() != "echo";
  const std::string tflops_text =
      computes ? absl::StrFormat(", %.4g TFLOP/s", tflops) : " (attnecho: no compute)";
  const std::string tflops_json = computes ? absl::StrFormat("%.6g", tflops) : "null";
  const std::string q_len_json = workload == "decode" ? "null" : absl::StrCat(config.q_len);
  std::vector<std::string> codes;
  for (const auto& [code, count] : s.errors) codes.push_back(absl::StrCat(code, "=", count));
  if (s.wrong > 0) codes.push_back(absl::StrCat("WRONG_RESULT=", s.wrong));
  const std::string mode =
      rate > 0 ? absl::StrFormat("open loop, %.1f req/s target, at most %d outstanding", rate,
                                 concurrency)
               : absl::StrFormat("closed loop, %d clients", concurrency);
  std::cout << absl::StrFormat(
      "attnbench: %s workload, %s, %s\n"
      "server:     %s backend, %s, %d qo heads, %d kv heads, head_dim %d, page_size %d, %s\n"
      "requests:   %d in %.2f s (%d OK, %d dropped by the open loop)%s\n"
      "throughput: %.1f requests/s, %.1f query rows/s%s\n"
      "latency ms: p50 %s  p90 %s  p99 %s  max %s\n"
      "errors:     %s\n"
      "requests per launch: %s\n",
      workload, ShapeText(config), mode, info.backend(),
      info.attention() == v1::ATTENTION_MLA
          ? absl::StrFormat("MLA (kv_lora_rank %d, qk_rope_head_dim %d)", info.kv_lora_rank(),
                            info.qk_rope_head_dim())
          : std::string("GQA"),
      info.num_qo_heads(), info.num_kv_heads(), info.head_dim(),
      info.page_size(), v1::DType_Name(info.kv_dtype()), s.done, elapsed, s.ok, s.dropped,
      verify ? ", every response verified" : "", rps, rows_ps, tflops_text, FormatMs(s.Percentile(50)),
      FormatMs(s.Percentile(90)), FormatMs(s.Percentile(99)), FormatMs(s.Percentile(100)),
      codes.empty() ? "none" : absl::StrJoin(codes, " "), metrics_note);

  const std::string path = absl::GetFlag(FLAGS_json);
  if (path.empty()) return s.Errors();
  std::vector<std::string> errors;
  for (const auto& [code, count] : s.errors) errors.push_back(absl::StrFormat("\"%s\": %d", code, count));
  std::vector<std::string> samples;
  samples.reserve(s.samples.size());
  for (double x : s.samples) samples.push_back(absl::StrFormat("%.6g", x * 1e3));
  std::ofstream f(path);
  f << absl::StrFormat(
      "{\n  \"workload\": \"%s\", \"mode\": \"%s\", \"concurrency\": %d, \"rate\": %.6g,\n"
      "  \"batch\": %d, \"q_len\": %s, \"kv_len\": %d, \"verify\": %s,\n"
      "  \"backend\": \"%s\", \"num_qo_heads\": %d, \"num_kv_heads\": %d, \"head_dim\": %d,\n"
      "  \"page_size\": %d, \"kv_dtype\": \"%s\",\n"
      "  \"requests\": %d, \"ok\": %d, \"dropped\": %d, \"elapsed_s\": %.6g,\n"
      "  \"requests_per_s\": %.6g, \"query_rows_per_s\": %.6g, \"tflops\": %s,\n"
      "  \"latency_ms\": {\"p50\": %s, \"p90\": %s, \"p99\": %s, \"max\": %s},\n"
      "  \"errors\": %d, \"errors_by_code\": {%s}, \"wrong_results\": %d,\n"
      "  \"mean_requests_per_launch\": %s,\n"
      "  \"latencies_ms\": [%s]\n}\n",
      workload, rate > 0 ? "open" : "closed", concurrency, rate, config.batch, q_len_json, config.kv_len,
      verify ? "true" : "false", info.backend(), info.num_qo_heads(), info.num_kv_heads(), info.head_dim(),
      info.page_size(), v1::DType_Name(info.kv_dtype()), s.done, s.ok, s.dropped, elapsed, rps, rows_ps,
      tflops_json, FormatMs(s.Percentile(50)), FormatMs(s.Percentile(90)), FormatMs(s.Percentile(99)),
      FormatMs(s.Percentile(100)), s.Errors(), absl::StrJoin(errors, ", "), s.wrong,
      per_launch ? absl::StrFormat("%.6g", *per_launch) : "null", absl::StrJoin(samples, ", "));
  if (!f.good()) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  return s.Errors();
}

int Main() {
  if (absl::GetFlag(FLAGS_retain_freed_memory)) RetainFreedMemory();
  // SIGINT / SIGTERM end the run early; the clients then release what they
  // hold (a second signal ends the process at once; the leases release it).
  std::signal(SIGINT, OnInterrupt);
  std::signal(SIGTERM, OnInterrupt);
  if (absl::Status s = CheckFlags(); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  BenchConfig config = ConfigFromFlags();
  const std::vector<ShapeSpec> specs = ShapesOf(config.workload, config.q_len, config.kv_len);
  const int32_t concurrency = absl::GetFlag(FLAGS_concurrency);
  const std::string metrics = absl::GetFlag(FLAGS_metrics);

  ClientOptions options = ClientOptionsFromFlags();
  auto info_client = Client::Connect(options);
  if (!info_client.ok()) {
    std::cerr << "error: " << info_client.status().ToString() << "\n";
    return 1;
  }
  if (absl::Status s = CheckServer((*info_client)->info(), config, specs, concurrency); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 1;
  }
  // --metrics, asked for, is reachable before anything is set up.
  if (!metrics.empty()) {
    if (auto m = ScrapeBatchRequests(metrics); !m.ok()) {
      std::cerr << "error: --metrics=" << metrics << ": " << m.status().message() << "\n";
      return 1;
    }
  }
  // The same sinks in every client.
  std::mt19937_64 sink_gen(absl::GetFlag(FLAGS_seed));
  auto attention = AttentionOptionsFromFlags((*info_client)->info().num_qo_heads(), sink_gen);
  if (!attention.ok()) {
    std::cerr << "error: set-up: " << attention.status().ToString() << "\n";
    return 1;
  }
  config.attention = *attention;

  // Set-up: every client connects, allocates and writes its K/V (in parallel).
  std::vector<BenchWorker> workers(concurrency);
  std::vector<absl::Status> setup(concurrency);
  {
    std::vector<std::thread> threads;
    for (int i = 0; i < concurrency; ++i) {
      threads.emplace_back([&, i] {
        setup[i] = workers[i].SetUp(options, specs, config, absl::GetFlag(FLAGS_seed) * 1000003 + i, i);
      });
    }
    for (auto& t : threads) t.join();
  }
  for (const absl::Status& s : setup) {
    if (!s.ok()) {
      std::cerr << "error: set-up: " << s.ToString() << "\n";
      for (BenchWorker& w : workers) w.TearDown();
      return 1;
    }
  }
  const v1::ServerInfo info = (*info_client)->info();

  std::optional<std::pair<double, double>> metrics_before;
  std::string metrics_note = "not measured (no --metrics)";
  if (!metrics.empty()) {
    auto m = ScrapeBatchRequests(metrics);
    if (m.ok()) {
      metrics_before = *m;
    } else {
      metrics_note = absl::StrCat("not measured (", m.status().ToString(), ")");
    }
  }
  if (Interrupted()) {
    for (BenchWorker& w : workers) w.TearDown();
    std::cerr << "interrupted during set-up: nothing measured\n";
    return 130;
  }
  LatencyStats stats;
  const double elapsed = RunTimed(workers, &stats);
  std::optional<double> per_launch;
  if (metrics_before) {
    auto m = ScrapeBatchRequests(metrics);
    if (!m.ok()) {
      metrics_note = absl::StrCat("not measured (", m.status().ToString(), ")");
    } else if (m->second - metrics_before->second <= 0) {
      metrics_note = "not measured (no attention launch counted)";
    } else {
      per_launch = (m->first - metrics_before->first) / (m->second - metrics_before->second);
      metrics_note = absl::StrFormat("%.2f", *per_launch);
    }
  }
  for (BenchWorker& w : workers) w.TearDown();
  const absl::StatusOr<int64_t> errors = Report(info, config, stats, elapsed, per_launch, metrics_note);
  if (!errors.ok()) {
    std::cerr << "error: " << errors.status().message() << "\n";
    return 1;
  }
  if (Interrupted()) {
    std::cerr << "interrupted: the report covers the " << elapsed << " s that ran\n";
    return 130;
  }
  return *errors == 0 ? 0 : 1;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  attnserve::ParseCommandLine(
      argc, argv,
      {"attnbench",
       "attnbench [flags]: closed-loop (--concurrency) or open-loop (--rate) load on a running\n"
       "attnserve. Each client holds --batch x ceil(--kv_len / page_size) KV pages per request\n"
       "shape for the run; --verify checks every response against a float64 reference.",
       {{"client/attnbench.cc", "Flags"}, {"client/cli_flags.cc", "Connection flags"},
        {"client/variant_flags.cc", "Attention option flags"}}});
  attnserve::HideGrpcLogs();
  return attnserve::Main();
}
