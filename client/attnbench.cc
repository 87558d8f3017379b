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
#include "client/channel.h"
#include "client/cli_flags.h"
#include "client/client.h"
#ifdef ATTNSERVE_CLIENT_CUDA
#include "client/cuda_memory.h"
#endif
#include "client/shared_memory.h"
#include "client/workload.h"
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

using Clock = std::chrono::steady_clock;

constexpr int kVariants = 2;                   // requests per shape and client: same pages, other q

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// One request shape, built once per client: its inputs, reference and cost.
struct Shape {
  std::string name;
  PrefillInputs in;
  std::vector<double> o_ref, lse_ref;  // with --verify
  int64_t rows = 0;                    // query rows
  double flops = 0;  // 2 * (head_dim + VDim) * num_qo_heads * visible pairs
};

// Sequences of (q_len, kv_len) each over consecutive pages taken from `pages`
// starting at *next.
Shape MakeShape(std::mt19937_64& gen, const KvGeometry& g, const std::string& name, int32_t batch,
                int32_t q_len, int32_t kv_len, const AttentionOptions& options,
                const std::vector<int32_t>& pages, size_t* next) {
  Shape s;
  s.name = name;
  PrefillInputs& in = s.in;
  in.layer = absl::GetFlag(FLAGS_layer);
  in.causal = true;
  in.options = options;
  const int64_t window = options.window_left.value_or(-1);
  in.qo_indptr.push_back(0);
  in.kv_indptr.push_back(0);
  const int32_t num_pages = (kv_len + g.page_size - 1) / g.page_size;
  int64_t visible = 0;
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t p = 0; p < num_pages; ++p) in.kv_indices.push_back(pages[(*next)++]);
    in.qo_indptr.push_back(in.qo_indptr.back() + q_len);
    in.kv_indptr.push_back(in.kv_indptr.back() + num_pages);
    in.kv_last_page_len.push_back(num_pages == 0 ? 0 : kv_len - (num_pages - 1) * g.page_size);
    // Row i at position p = i + kv_len - q_len sees keys [p - window, p].
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t p = i + kv_len - q_len;
      const int64_t end = std::max<int64_t>(0, std::min<int64_t>(kv_len, p + 1));
      const int64_t begin = window >= 0 ? std::max<int64_t>(0, p - window) : 0;
      visible += std::max<int64_t>(0, end - begin);
    }
  }
  in.q = RandomHalves(gen, g.dtype, in.total_q() * g.num_qo_heads * g.head_dim);
  s.rows = in.total_q();
  // 2 x (QK width + PV width) per visible (query, key) pair and head: 4 x
  // head_dim for GQA, 2 x (576 + 512) for DeepSeek's MLA.
  s.flops = 2.0 * (g.head_dim + g.VDim()) * g.num_qo_heads * static_cast<double>(visible);
  return s;
}

struct ShapeSpec {
  std::string name;
  int32_t q_len, kv_len;
};

// KV pages one client holds for the run: `batch` sequences of kv_len keys per
// shape. The variants of a shape read the same pages with different queries.
int64_t PagesPerClient(const std::vector<ShapeSpec>& specs, int32_t batch, int32_t page_size) {
  int64_t pages = 0;
  for (const ShapeSpec& s : specs) pages += int64_t{batch} * ((int64_t{s.kv_len} + page_size - 1) / page_size);
  return pages;
}

// The request shape as the banner shows it: only the lengths the workload uses.
std::string ShapeText(const std::string& workload) {
  const int32_t batch = absl::GetFlag(FLAGS_batch);
  const int32_t q = absl::GetFlag(FLAGS_q_len), kv = absl::GetFlag(FLAGS_kv_len);
  if (workload == "decode") {
    return absl::StrFormat("batch=%d kv_len=%d (one query row per sequence)", batch, kv);
  }
  if (workload == "prefill") return absl::StrFormat("batch=%d q_len=%d (keys = queries)", batch, q);
  return absl::StrFormat("batch=%d q_len=%d kv_len=%d", batch, q, kv);
}

std::vector<ShapeSpec> ShapesOf(const std::string& workload) {
  const int32_t q = absl::GetFlag(FLAGS_q_len), kv = absl::GetFlag(FLAGS_kv_len);
  const ShapeSpec decode{"decode", 1, kv}, prefill{"prefill", q, q}, prefix{"prefix", q, kv};
  if (workload == "decode") return {decode};
  if (workload == "prefill") return {prefill};
  if (workload == "prefix") return {prefix};
  if (workload == "mixed") return {decode, prefill, prefix};
  return {};
}

// One client: its connection, pages, K/V copy and prepared requests.
class Worker {
 public:
  absl::Status SetUp(const ClientOptions& options, const std::vector<ShapeSpec>& specs,
                     uint64_t seed, bool verify, int index) {
    auto client = Client::Connect(options);
    if (!client.ok()) return client.status();
    client_ = *std::move(client);
    const KvGeometry g = GeometryOf(client_->info());
    const int32_t batch = absl::GetFlag(FLAGS_batch);
    const int64_t need = PagesPerClient(specs, batch, g.page_size);
    auto pages = client_->AllocatePages(static_cast<int32_t>(std::max<int64_t>(need, 1)));
    if (!pages.ok()) return pages.status();
    pages_ = *std::move(pages);
    std::mt19937_64 gen(seed);
    std::shuffle(pages_.begin(), pages_.end(), gen);
    std::mt19937_64 sink_gen(absl::GetFlag(FLAGS_seed));  // the same sinks in every client
    auto attention = AttentionOptionsFromFlags(g.num_qo_heads, sink_gen);
    if (!attention.ok()) return attention.status();
    mirror_ = std::make_unique<KvMirror>(g);
    const int32_t layer = absl::GetFlag(FLAGS_layer);
    if (g.KvIsFp8() && absl::GetFlag(FLAGS_kv_scale) > 0) {
      const float scale = static_cast<float>(absl::GetFlag(FLAGS_kv_scale));
      absl::Status s = client_->SetKvScales({LayerKvScales{layer, {scale}, {scale}}});
      if (!s.ok()) return s;
    }
    // The server's scales: the mirror quantizes (--fp8_rows: the rows sent)
    // and dequantizes with them.
    if (absl::Status s = MirrorServerScales(*client_, mirror_.get()); !s.ok()) return s;
    const bool fp8_rows = g.KvIsFp8() && absl::GetFlag(FLAGS_fp8_rows);
    const std::vector<int64_t> slots = SlotsOfPages(g, pages_);
    // Written in pieces so that no WriteKV approaches the message limit.
    const size_t chunk = std::max<int64_t>(1, (16ll << 20) / (g.NumPools() * g.RowElems()));
    for (size_t at = 0; at < slots.size(); at += chunk) {
      const size_t n = std::min(chunk, slots.size() - at);
      absl::Span<const int64_t> part = absl::MakeConstSpan(slots).subspan(at, n);
      auto k = RandomHalves(gen, g.dtype, static_cast<int64_t>(n) * g.RowElems());
      // MLA: the latent rows in k alone.
      auto v = RandomHalves(gen, g.dtype, g.HasVPool() ? static_cast<int64_t>(n) * g.RowElems() : 0);
      if (fp8_rows) {
        // Quantized here as the server would (the mirror's copy is exactly
        // that), and sent as stored.
        mirror_->Write(layer, part, k, v);
        std::vector<uint8_t> k8(n * g.RowElems()), v8(k8.size());
        for (size_t i = 0; i < n; ++i) {
          std::memcpy(k8.data() + i * g.RowElems(), mirror_->StoredK(layer, part[i]), g.RowElems());
          std::memcpy(v8.data() + i * g.RowElems(), mirror_->StoredV(layer, part[i]), g.RowElems());
        }
        absl::Status s = client_->WriteKVFp8(layer, part, k8, v8);
        if (!s.ok()) return s;
        continue;
      }
      absl::Status s = client_->WriteKV(layer, part, k, v);
      if (!s.ok()) return s;
      mirror_->Write(layer, part, k, v);
    }
    // Shapes in the order requests cycle through them: mixed alternates. Each
    // shape has its own pages; its variants share them.
    std::vector<size_t> first_page(specs.size(), 0);
    for (size_t i = 1; i < specs.size(); ++i) {
      first_page[i] = first_page[i - 1] + static_cast<size_t>(PagesPerClient({specs[i - 1]}, batch,
                                                                             g.page_size));
    }
    for (int variant = 0; variant < kVariants; ++variant) {
      for (size_t i = 0; i < specs.size(); ++i) {
        const ShapeSpec& s = specs[i];
        size_t next = first_page[i];
        shapes_.push_back(
            MakeShape(gen, g, s.name, batch, s.q_len, s.kv_len, *attention, pages_, &next));
        if (verify) {
          ReferencePrefill(*mirror_, shapes_.back().in, &shapes_.back().o_ref,
                           &shapes_.back().lse_ref);
        }
      }
    }
    if (absl::GetFlag(FLAGS_plan)) {
      for (const Shape& sh : shapes_) {
        PlanLayout layout;
        layout.qo_indptr = sh.in.qo_indptr;
        layout.kv_indptr = sh.in.kv_indptr;
        layout.kv_indices = sh.in.kv_indices;
        layout.kv_last_page_len = sh.in.kv_last_page_len;
        layout.kv_keys_after = sh.in.kv_keys_after;
        layout.options = sh.in.options;  // the plan carries them; the Prefills do not
        auto id = client_->CreatePlan(layout);
        if (!id.ok()) return id.status();
        plan_ids_.push_back(*id);
      }
    }
    if (absl::GetFlag(FLAGS_shm)) {
      // One region for the largest shape: q, then the output, then the LSE;
      // with --channel the system region starts with the ring. With
      // --cuda_device the tensors are in a CUDA region of their own.
      int64_t rows = 0;
      for (const Shape& sh : shapes_) rows = std::max(rows, sh.in.total_q());
      const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim * KvDTypeBytes(g.dtype);
      const bool channel = absl::GetFlag(FLAGS_channel);
      const int32_t cuda_device = absl::GetFlag(FLAGS_cuda_device);
      // One slot (this worker sends one request at a time) of 1 MiB, room
      // for a layout of 250k page ids.
      const int64_t ring_bytes = channel ? ChannelBytes(1, kChannelSlotBytes) : 0;
      q_at_ = cuda_device >= 0 ? 0 : (ring_bytes + 4095) / 4096 * 4096;
      o_at_ = q_at_ + (rows * q_row + 4095) / 4096 * 4096;
      lse_at_ = o_at_ + (rows * q_row + 4095) / 4096 * 4096;
      const int64_t tensor_bytes = lse_at_ + rows * g.num_qo_heads * 4;
      region_ = absl::StrCat("attnbench-", getpid(), "-", index);
      tensor_region_ = region_;
      if (cuda_device >= 0) {
#ifdef ATTNSERVE_CLIENT_CUDA
        tensor_region_ = region_ + "-cuda";
        auto memory = CudaMemory::Create(cuda_device, tensor_bytes);
        if (!memory.ok()) return memory.status();
        cuda_ = *std::move(memory);
        absl::Status s = client_->RegisterCudaRegion(tensor_region_, cuda_->ipc_handle(),
                                                     cuda_device, cuda_->size());
        if (!s.ok()) return s;
#else
        return absl::UnimplementedError("--cuda_device: this attnbench was built without CUDA");
#endif
      }
      if (cuda_device < 0 || channel) {
        auto shm = SharedMemory::Create(region_, cuda_device >= 0 ? ring_bytes : tensor_bytes);
        if (!shm.ok()) return shm.status();
        shm_ = *std::move(shm);
        absl::Status s = client_->RegisterSystemRegion(region_, *shm_, 0, shm_->size());
        if (!s.ok()) return s;
      }
      if (channel) {
        ChannelOptions channel_options;
        channel_options.slot_count = 1;
        channel_options.slot_bytes = kChannelSlotBytes;
        channel_options.spin_us = options.busy_poll ? 10'000'000 : 100;
        auto opened = client_->OpenChannel(region_, shm_->data(), 0, ring_bytes, channel_options);
        if (!opened.ok()) return opened.status();
        channel_ = *std::move(opened);
      }
    }
    return absl::OkStatus();
  }

  // Sends the next request; latency runs from `start` (its scheduled arrival
  // in the open loop).
  void SendOne(Clock::time_point start, bool verify, LatencyStats* stats) {
    const size_t index = next_++ % shapes_.size();
    const Shape& shape = shapes_[index];
    PrefillArgs args = ArgsOf(shape.in);
    if (!plan_ids_.empty()) {
      args.plan_id = plan_ids_[index];
      args.qo_indptr = {};
      args.kv_indptr = {};
      args.kv_indices = {};
      args.kv_last_page_len = {};
      args.kv_keys_after = {};
      args.options = {};
      args.q_rows = shape.in.total_q();
    }
    const int64_t q_bytes = static_cast<int64_t>(shape.in.q.size()) * 2;
    const KvGeometry geo = GeometryOf(client_->info());
    const int64_t lse_bytes = q_bytes / (2 * geo.head_dim) * 4;
    // An MLA server's outputs are v_head_dim wide: o_bytes of the region.
    const int64_t o_bytes = q_bytes / geo.head_dim * geo.VDim();
    const bool in_region = !tensor_region_.empty();
    if (in_region) {
      // Not timed: the query is where an engine would compute it.
      const Clock::time_point copy_start = Clock::now();
      absl::Status put = PutQuery(shape.in.q.data(), q_bytes);
      // Poisoned before a checked request: an output byte the server does
      // not write is a NaN the comparison counts.
      if (put.ok() && verify) put = PoisonOutputs(o_bytes, lse_bytes);
      start += Clock::now() - copy_start;
      if (!put.ok()) {
        stats->Record(0, put, false, shape.rows, shape.flops);
        return;
      }
      args.q = {};
      args.q_region = RegionRef{tensor_region_, q_at_, q_bytes};
      args.q_rows = shape.in.total_q();
      args.output_region = RegionRef{tensor_region_, o_at_, o_bytes};
      args.lse_region = RegionRef{tensor_region_, lse_at_, lse_bytes};
    }
    // Into the same result every time, as an engine reuses its buffers.
    absl::Status status = channel_ != nullptr ? channel_->PrefillInto(args, &result_)
                                              : client_->PrefillInto(args, &result_);
    const double latency = Seconds(Clock::now() - start);
    if (status.ok() && in_region && verify) status = GetResult(o_bytes, lse_bytes);
    bool wrong = false;
    if (status.ok() && verify) {
      const KvDType dtype = GeometryOf(client_->info()).dtype;
      const Comparison c = Compare(dtype, shape.o_ref, shape.lse_ref, result_.o, result_.lse);
      wrong = !c.Ok(dtype);
      if (wrong) std::cerr << "\nwrong result (" << shape.name << "): " << c.ToString() << "\n";
    }
    stats->Record(latency, status, wrong, shape.rows, shape.flops);
    BackOffAfter(status);
  }

  // After UNAVAILABLE (a draining server, or one that is gone) the next
  // request waits a random time in [0, backoff_s_], which doubles from 10 ms
  // up to 1 s while the failures last; a success resets it. gRPC's retry
  // policy (common/transport.h) has already retried the request itself.
  void BackOffAfter(const absl::Status& status) {
    if (!absl::IsUnavailable(status)) {
      backoff_s_ = 0;
      return;
    }
    backoff_s_ = std::clamp(backoff_s_ * 2, 0.01, 1.0);
    std::uniform_real_distribution<double> wait(0, backoff_s_);
    std::this_thread::sleep_for(std::chrono::duration<double>(wait(jitter_)));
  }

  // The query into the tensor region (untimed).
  absl::Status PutQuery(const uint16_t* q, int64_t q_bytes) {
#ifdef ATTNSERVE_CLIENT_CUDA
    if (cuda_ != nullptr) return cuda_->CopyIn(q_at_, q, q_bytes);
#endif
    std::memcpy(shm_->data() + q_at_, q, q_bytes);
    return absl::OkStatus();
  }

  // 0xff over the output and LSE in the tensor region (NaN halves and floats).
  absl::Status PoisonOutputs(int64_t o_bytes, int64_t lse_bytes) {
#ifdef ATTNSERVE_CLIENT_CUDA
    if (cuda_ != nullptr) {
      absl::Status s = cuda_->Fill(o_at_, o_bytes, 0xff);
      return s.ok() ? cuda_->Fill(lse_at_, lse_bytes, 0xff) : s;
    }
#endif
    std::memset(shm_->data() + o_at_, 0xff, o_bytes);
    std::memset(shm_->data() + lse_at_, 0xff, lse_bytes);
    return absl::OkStatus();
  }

  // The output and LSE from the tensor region into result_ (for --verify).
  absl::Status GetResult(int64_t o_bytes, int64_t lse_bytes) {
    result_.o.resize(o_bytes / 2);
    result_.lse.resize(lse_bytes / 4);
#ifdef ATTNSERVE_CLIENT_CUDA
    if (cuda_ != nullptr) {
      absl::Status s = cuda_->CopyOut(o_at_, result_.o.data(), o_bytes);
      return s.ok() ? cuda_->CopyOut(lse_at_, result_.lse.data(), lse_bytes) : s;
    }
#endif
    std::memcpy(result_.o.data(), shm_->data() + o_at_, o_bytes);
    std::memcpy(result_.lse.data(), shm_->data() + lse_at_, lse_bytes);
    return absl::OkStatus();
  }

  void TearDown() {
    for (uint64_t id : plan_ids_) {
      absl::Status s = client_->ReleasePlan(id);
      if (!s.ok()) std::cerr << "release plan: " << s.ToString() << "\n";
    }
    plan_ids_.clear();
    channel_.reset();  // CloseChannel
    if (client_ != nullptr && shm_ != nullptr) {
      absl::Status s = client_->UnregisterRegion(region_);
      if (!s.ok()) std::cerr << "unregister region: " << s.ToString() << "\n";
      shm_.reset();
    }
#ifdef ATTNSERVE_CLIENT_CUDA
    if (client_ != nullptr && cuda_ != nullptr) {
      absl::Status s = client_->UnregisterRegion(tensor_region_);
      if (!s.ok()) std::cerr << "unregister region: " << s.ToString() << "\n";
      cuda_.reset();
    }
#endif
    if (client_ != nullptr && !pages_.empty()) {
      absl::Status s = client_->FreePages(pages_);
      if (!s.ok()) std::cerr << "free pages: " << s.ToString() << "\n";
    }
  }

 private:
  std::unique_ptr<Client> client_;
  std::vector<int32_t> pages_;
  std::unique_ptr<KvMirror> mirror_;
  std::vector<Shape> shapes_;
  std::vector<uint64_t> plan_ids_;  // --plan: one per shape, in shapes_' order
  size_t next_ = 0;
  double backoff_s_ = 0;        // BackOffAfter
  std::mt19937_64 jitter_{std::random_device{}()};
  PrefillResult result_;  // reused by every request
  // --shm: the client's system region (the ring of --channel at 0) and the
  // region of its tensors (q at q_at_, output at o_at_, LSE at lse_at_): the
  // same region, or with --cuda_device a CUDA region of its own.
  std::unique_ptr<SharedMemory> shm_;
  std::string region_, tensor_region_;
#ifdef ATTNSERVE_CLIENT_CUDA
  std::unique_ptr<CudaMemory> cuda_;
#endif
  int64_t q_at_ = 0, o_at_ = 0, lse_at_ = 0;
  static constexpr int32_t kChannelSlotBytes = 1 << 20;
  std::unique_ptr<RequestChannel> channel_;  // --channel
};

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

int Main() {
  if (absl::GetFlag(FLAGS_retain_freed_memory)) RetainFreedMemory();
  const std::string workload = absl::GetFlag(FLAGS_workload);
  const std::vector<ShapeSpec> specs = ShapesOf(workload);
  const int32_t concurrency = absl::GetFlag(FLAGS_concurrency);
  const double rate = absl::GetFlag(FLAGS_rate);
  const int64_t max_requests = absl::GetFlag(FLAGS_requests);
  const double duration_s = absl::GetFlag(FLAGS_duration_s) > 0 ? absl::GetFlag(FLAGS_duration_s)
                                                                : (max_requests > 0 ? 0 : 10);
  const bool verify = absl::GetFlag(FLAGS_verify);
  const std::string metrics = absl::GetFlag(FLAGS_metrics);
  if (specs.empty()) {
    std::cerr << "error: --workload must be decode, prefill, prefix or mixed\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_channel) && !absl::GetFlag(FLAGS_shm)) {
    std::cerr << "error: --channel needs --shm (the channel's ring lives in the shm region)\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_cuda_device) >= 0 && !absl::GetFlag(FLAGS_shm)) {
    std::cerr << "error: --cuda_device needs --shm (it moves the --shm tensors to the GPU)\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_cuda_device) < -1) {
    std::cerr << "error: --cuda_device must be -1 (off) or a GPU index >= 0\n";
    return 2;
  }
  if (concurrency < 1 || absl::GetFlag(FLAGS_batch) < 1 || absl::GetFlag(FLAGS_q_len) < 1 ||
      absl::GetFlag(FLAGS_kv_len) < 1 || !(rate >= 0) || max_requests < 0 ||
      !(absl::GetFlag(FLAGS_duration_s) >= 0)) {
    std::cerr << "error: --concurrency, --batch, --q_len, --kv_len must be >= 1; --rate, "
                 "--requests, --duration_s >= 0\n";
    return 2;
  }
  // Bounds that keep the run's arithmetic (its end time, page counts, the
  // request's tensors) far from overflowing.
  if (!(rate <= 1e9) || !(absl::GetFlag(FLAGS_duration_s) <= 1e7)) {
    std::cerr << "error: --rate must be at most 1e9 requests/s and --duration_s at most 1e7 s\n";
    return 2;
  }
  constexpr int32_t kMaxLen = 1 << 24;
  if (absl::GetFlag(FLAGS_q_len) > kMaxLen || absl::GetFlag(FLAGS_kv_len) > kMaxLen ||
      absl::GetFlag(FLAGS_batch) > kMaxLen) {
    std::cerr << "error: --batch, --q_len and --kv_len must be at most " << kMaxLen << "\n";
    return 2;
  }
  if (const double scale = absl::GetFlag(FLAGS_kv_scale); !(scale >= 0) || !std::isfinite(scale)) {
    std::cerr << "error: --kv_scale=" << scale << " must be finite and >= 0 (0: keep the server's)\n";
    return 2;
  }
  if (absl::Status s = CheckClientFlags(); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }

  ClientOptions options = ClientOptionsFromFlags();
  auto info_client = Client::Connect(options);
  if (!info_client.ok()) {
    std::cerr << "error: " << info_client.status().ToString() << "\n";
    return 1;
  }
  // Every client holds its pages for the whole run: say so before allocating
  // when they cannot fit.
  const v1::ServerInfo& start_info = (*info_client)->info();
  if (const std::string want = absl::GetFlag(FLAGS_kv_dtype); !want.empty()) {
    const KvGeometry g = GeometryOf(start_info);
    const std::string have =
        g.KvIsFp8() ? Fp8FormatName(g.kv_fp8) : (g.dtype == KvDType::kBf16 ? "bf16" : "fp16");
    if (want != have) {
      std::cerr << "error: --kv_dtype=" << want << ", but the server's KV cache is " << have
                << " (its --kv_dtype)\n";
      return 1;
    }
  }
  // A request's queries must fit a message (the output is as large), or with
  // --shm stay a sane size for one client's region.
  {
    int32_t most_q = 1;
    for (const ShapeSpec& sp : specs) most_q = std::max(most_q, sp.q_len);
    const int64_t q_bytes = int64_t{absl::GetFlag(FLAGS_batch)} * most_q * start_info.num_qo_heads() *
                            start_info.head_dim() * 2;
    const int64_t most = absl::GetFlag(FLAGS_shm) ? (int64_t{1} << 32) : start_info.max_message_bytes();
    if (q_bytes > most) {
      std::cerr << absl::StrFormat(
          "error: --batch=%d x --q_len=%d query rows a request are %d bytes of queries, more than "
          "the %d a request may carry (%s): lower --batch or --q_len\n",
          absl::GetFlag(FLAGS_batch), most_q, q_bytes, most,
          absl::GetFlag(FLAGS_shm) ? "4 GiB a region" : "the server's max_message_bytes");
      return 1;
    }
  }
  const int64_t per_client =
      PagesPerClient(specs, absl::GetFlag(FLAGS_batch), start_info.page_size());
  if (per_client * concurrency > start_info.free_pages()) {
    int32_t most_keys = 0;
    for (const ShapeSpec& s : specs) most_keys = std::max(most_keys, s.kv_len);
    std::cerr << absl::StrFormat(
        "error: --concurrency=%d clients x %d KV pages each (--batch=%d sequences of up to %d "
        "keys, page_size %d, per request shape) = %d pages, but the server has %d of its %d "
        "pages free: lower --concurrency, --batch or --kv_len (--q_len for prefill), or start "
        "attnserve with more --num_pages\n",
        concurrency, per_client, absl::GetFlag(FLAGS_batch), most_keys, start_info.page_size(),
        per_client * concurrency, start_info.free_pages(), start_info.num_pages());
    return 1;
  }

  // Set-up: every client connects, allocates and writes its K/V (in parallel).
  std::vector<Worker> workers(concurrency);
  std::vector<absl::Status> setup(concurrency);
  {
    std::vector<std::thread> threads;
    for (int i = 0; i < concurrency; ++i) {
      threads.emplace_back([&, i] {
        setup[i] =
            workers[i].SetUp(options, specs, absl::GetFlag(FLAGS_seed) * 1000003 + i, verify,
                                static_cast<int>(i));
      });
    }
    for (auto& t : threads) t.join();
  }
  for (const absl::Status& s : setup) {
    if (!s.ok()) {
      std::cerr << "error: set-up: " << s.ToString() << "\n";
      for (Worker& w : workers) w.TearDown();
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

  // The timed run.
  LatencyStats stats;
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
      Worker& w = workers[i];
      if (rate > 0) {
        while (auto t = arrivals.Pop()) {
          w.SendOne(*t, verify, &stats);
          arrivals.Done();
        }
        return;
      }
      while (Clock::now() < end) {
        if (max_requests > 0 && issued.fetch_add(1) >= max_requests) break;
        w.SendOne(Clock::now(), verify, &stats);
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
      while (!stop.load() && (max_requests <= 0 || accepted < max_requests)) {
        t += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(gen)));
        if (t >= end) break;
        std::this_thread::sleep_until(t);
        if (arrivals.Push(t)) {
          ++accepted;
        } else {
          stats.Dropped();
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
      const LatencyStats::Snapshot s = stats.Take(false);
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
  for (Worker& w : workers) w.TearDown();

  // Report.
  const LatencyStats::Snapshot s = stats.Take(!absl::GetFlag(FLAGS_json).empty());
  const double rps = s.ok / elapsed, rows_ps = s.rows / elapsed, tflops = s.flops / elapsed / 1e12;
  // attnecho computes nothing: no FLOP rate for it. A decode request has
  // one query row per sequence, whatever --q_len says.
  const bool computes = info.backend() != "echo";
  const std::string tflops_text =
      computes ? absl::StrFormat(", %.4g TFLOP/s", tflops) : " (attnecho: no compute)";
  const std::string tflops_json = computes ? absl::StrFormat("%.6g", tflops) : "null";
  const std::string q_len_json =
      workload == "decode" ? "null" : absl::StrCat(absl::GetFlag(FLAGS_q_len));
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
      workload, ShapeText(workload), mode, info.backend(),
      info.attention() == v1::ATTENTION_MLA
          ? absl::StrFormat("MLA (kv_lora_rank %d, qk_rope_head_dim %d)", info.kv_lora_rank(),
                            info.qk_rope_head_dim())
          : std::string("GQA"),
      info.num_qo_heads(), info.num_kv_heads(), info.head_dim(),
      info.page_size(), v1::DType_Name(info.kv_dtype()), s.done, elapsed, s.ok, s.dropped,
      verify ? ", every response verified" : "", rps, rows_ps, tflops_text, FormatMs(s.Percentile(50)),
      FormatMs(s.Percentile(90)), FormatMs(s.Percentile(99)), FormatMs(s.Percentile(100)),
      codes.empty() ? "none" : absl::StrJoin(codes, " "), metrics_note);

  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::vector<std::string> errors;
    for (const auto& [code, count] : s.errors)
      errors.push_back(absl::StrFormat("\"%s\": %d", code, count));
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
        workload, rate > 0 ? "open" : "closed", concurrency, rate, absl::GetFlag(FLAGS_batch),
        q_len_json, absl::GetFlag(FLAGS_kv_len), verify ? "true" : "false",
        info.backend(), info.num_qo_heads(), info.num_kv_heads(), info.head_dim(), info.page_size(),
        v1::DType_Name(info.kv_dtype()), s.done, s.ok, s.dropped, elapsed, rps, rows_ps, tflops_json,
        FormatMs(s.Percentile(50)), FormatMs(s.Percentile(90)), FormatMs(s.Percentile(99)),
        FormatMs(s.Percentile(100)), s.Errors(), absl::StrJoin(errors, ", "), s.wrong,
        per_launch ? absl::StrFormat("%.6g", *per_launch) : "null", absl::StrJoin(samples, ", "));
    if (!f.good()) {
      std::cerr << "error: cannot write " << path << "\n";
      return 1;
    }
  }
  return s.Errors() == 0 ? 0 : 1;
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
