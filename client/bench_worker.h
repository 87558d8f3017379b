// attnbench's clients (client/attnbench.cc): the request shapes of a
// workload and one client's connection, pages, copy of its K/V and prepared
// requests. Not part of the installed client library.
//
//   BenchConfig config;  // from attnbench's flags
//   const std::vector<ShapeSpec> specs = ShapesOf(config.workload, config.q_len, config.kv_len);
//   BenchWorker w;
//   absl::Status s = w.SetUp(options, specs, config, /*seed=*/1, /*index=*/0);
//   w.SendOne(BenchClock::now(), &stats);  // the timed loop
//   w.TearDown();
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/bench_stats.h"
#include "client/channel.h"
#include "client/client.h"
#include "client/lease.h"
#ifdef ATTNSERVE_CLIENT_CUDA
#include "client/cuda_memory.h"
#endif
#include "client/shared_memory.h"
#include "client/workload.h"

namespace attnserve {

using BenchClock = std::chrono::steady_clock;

// What a run asks of every client (attnbench's flags, checked there).
struct BenchConfig {
  std::string workload = "decode";  // decode | prefill | prefix | mixed
  int32_t batch = 1, q_len = 128, kv_len = 1024, layer = 0;
  bool verify = false;    // compare every response with the float64 reference
  bool shm = false;       // q, output and LSE in a registered region
  bool channel = false;   // (with shm) requests through a request channel
  int32_t cuda_device = -1;  // (with shm) the tensors in a CUDA region on this GPU
  bool plan = false;      // requests name a plan made once per shape
  double kv_scale = 0;    // FP8 servers: set this K and V scale first (0: keep)
  bool fp8_rows = false;  // FP8 servers: send rows quantized here, as stored
  AttentionOptions attention;  // every request's (with plan, the plans')
};

// A request shape of the workload: query rows and keys per sequence.
struct ShapeSpec {
  std::string name;
  int32_t q_len, kv_len;
};

// The workload's shapes (mixed: decode, prefill, prefix); empty for an
// unknown workload.
std::vector<ShapeSpec> ShapesOf(const std::string& workload, int32_t q_len, int32_t kv_len);

// KV pages one client holds for the run: `batch` sequences of kv_len keys per
// shape. The variants of a shape read the same pages with different queries.
int64_t PagesPerClient(const std::vector<ShapeSpec>& specs, int32_t batch, int32_t page_size);

// The request shape as the banner shows it: only the lengths the workload uses.
std::string ShapeText(const BenchConfig& config);

// One request shape, built once per client: its inputs, reference and cost.
struct BenchShape {
  std::string name;
  PrefillInputs in;
  std::vector<double> o_ref, lse_ref, lse_bound;  // with verify (ReferencePrefill)
  int64_t rows = 0;                    // query rows
  double flops = 0;  // 2 * (head_dim + VDim) * num_qo_heads * visible pairs
};

// One client: its connection, pages, K/V copy and prepared requests.
class BenchWorker {
 public:
  // Connects, allocates and writes the K/V of every shape, registers the
  // plans and regions the config asks for.
  absl::Status SetUp(const ClientOptions& options, const std::vector<ShapeSpec>& specs,
                     const BenchConfig& config, uint64_t seed, int index);
  // Sends the next request; latency runs from `start` (its scheduled arrival
  // in the open loop).
  void SendOne(BenchClock::time_point start, LatencyStats* stats);
  // Releases the plans, channel, regions and pages, then revokes the lease
  // (errors printed).
  void TearDown();

 private:
  void BackOffAfter(const absl::Status& status);
  absl::Status PutQuery(const uint16_t* q, int64_t q_bytes);
  absl::Status PoisonOutputs(int64_t o_bytes, int64_t lse_bytes);
  absl::Status GetResult(int64_t o_bytes, int64_t lse_bytes);

  BenchConfig config_;
  KvGeometry geo_;  // the server's (SetUp), read by every request
  std::unique_ptr<Client> client_;
  // What the client makes is held under a lease: a run killed before its
  // TearDown leaves nothing held past the lease's ttl.
  std::unique_ptr<LeaseKeeper> lease_;
  std::vector<int32_t> pages_;
  std::unique_ptr<KvMirror> mirror_;
  std::vector<BenchShape> shapes_;
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

}  // namespace attnserve
