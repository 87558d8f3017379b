// CudaBackend: paged KV pools in device memory and the batched attention path
// (docs/design.md section 2.3). Everything is allocated in Init(); Submit and
// Complete orchestrate a BatchPacker (host: flatten, route to the decode and
// prefill families, plan, dedup, pack), LaunchAttention (one launch per
// family, then the prefill split merge) and a StagingRing (the pipelined
// slots and streams); WriteKv / ReadKv / ZeroPages copy through the idle slot
// synchronously.
//
// The compute stream runs batches in submission order, so a batch's appends
// never race another batch's attention. Split partials (both families) and
// the decode split counters are only touched on the compute stream and are
// shared by all slots.
#include "server/backend/cuda/cuda_backend.h"

#include <cuda.h>  // types of the driver entry point only: no libcuda link
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kernels/decode/decode_cuda.h"
#include "kernels/kv/kv_rows_cuda.h"
#include "kernels/merge/merge_cuda.h"
#include "kernels/prefill_cuda.h"
#include "server/backend/cuda/attention_launch.h"
#include "server/backend/cuda/batch_packer.h"
#include "server/backend/cuda/cuda_util.h"
#include "server/backend/cuda/staging_ring.h"
#include "server/core/status_macros.h"
#include "spdlog/spdlog.h"

namespace attnserve {

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear; "no driver" is not an error here
    return 0;
  }
  return n;
}

namespace {

using Ev = StagingRing::Event;

// States one MergeStatesCuda launch takes (kernels/merge/merge_cuda.h).
constexpr int32_t kMaxMergeStatesPerLaunch = 16;

// cuMemGetAddressRange through the runtime's driver entry point (no link
// against libcuda): the size of the allocation that holds `p`, or -1 when it
// cannot be asked.
int64_t AllocationBytes(void* p) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange get_range = []() -> GetRange {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) return -1;
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (get_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return -1;
  return static_cast<int64_t>(bytes - (reinterpret_cast<CUdeviceptr>(p) - base));
}

// System regions are page-locked once when registered, so that downloads
// land in them directly (PrefillTask::out_pinned) as in the pinned response
// buffers. A region that cannot be locked still works, through staging.
//
// CUDA regions: the IPC handle is opened once on the server's device with
// peer access enabled lazily, so a region exported on another GPU is copied
// device to device over NVLink (or PCIe peer-to-peer). The same handle
// registered twice (two regions of one allocation, as torch's caching
// allocator makes them) is opened once and reference-counted: the driver
// allows one mapping of an allocation per process and device.
class CudaRegionDevice final : public RegionDevice {
 public:
  explicit CudaRegionDevice(int device) : device_(device) {}

  absl::StatusOr<void*> OpenIpc(absl::string_view handle, int32_t device_id, int64_t bytes) override {
    const int count = CudaDeviceCount();
    if (device_id < 0 || device_id >= count) {
      return absl::InvalidArgumentError(absl::StrCat("cuda.device_id=", device_id, " out of range [0, ",
                                                     count, "): the CUDA devices this server sees"));
    }
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("cuda.ipc_handle has ", handle.size(),
                                                     " bytes: a cudaIpcMemHandle_t has ",
                                                     sizeof(cudaIpcMemHandle_t)));
    }
    absl::MutexLock lock(&mu_);
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (device_id != device_) {
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, device_, device_id) != cudaSuccess) cudaGetLastError();
      if (!can) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cuda.device_id=", device_id, ": the server's device ", device_,
            " has no peer access to it (a cuda region must be on the server's device or a peer)"));
      }
    }
    std::string key(handle);
    void* p = nullptr;
    auto it = open_.find(key);
    if (it != open_.end()) {
      p = it->second.ptr;
    } else {
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handle.data(), sizeof(h));
      const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess) {
        cudaGetLastError();  // not sticky: clear it
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda.ipc_handle does not open on device ", device_, ": ", cudaGetErrorName(err), " (",
            cudaGetErrorString(err), "); it must come from cudaIpcGetMemHandle in a live process"));
      }
    }
    // The allocation's size against what the request claims. (Its device
    // cannot be checked: pointer attributes of an imported mapping name the
    // importing device, so device_id is taken as the client states it.)
    absl::Status bad;
    const int64_t alloc = AllocationBytes(p);
    if (alloc >= 0 && bytes > alloc) {
      bad = absl::InvalidArgumentError(absl::StrCat("cuda.byte_size=", bytes,
                                                    " exceeds the allocation cuda.ipc_handle exports (",
                                                    alloc, " bytes)"));
    }
    if (!bad.ok()) {
      if (it == open_.end() && cudaIpcCloseMemHandle(p) != cudaSuccess) cudaGetLastError();
      return bad;
    }
    if (it != open_.end()) {
      it->second.refs += 1;
    } else {
      open_.emplace(std::move(key), Opened{p, 1});
    }
    return p;
  }

  void CloseIpc(void* device_ptr) override {
    absl::MutexLock lock(&mu_);
    for (auto it = open_.begin(); it != open_.end(); ++it) {
      if (it->second.ptr != device_ptr) continue;
      if (--it->second.refs == 0) {
        cudaSetDevice(device_);
        // Nothing uses the memory any more: every request that named it has
        // completed (its copies were synchronized before it finished).
        if (cudaIpcCloseMemHandle(device_ptr) != cudaSuccess) cudaGetLastError();
        open_.erase(it);
      }
      return;
    }
  }

  bool RegisterHost(void* data, int64_t bytes) override {
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) err = cudaHostRegister(data, size_t(bytes), cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      spdlog::warn("cudaHostRegister of a {}-byte region failed ({}); it is used through staging",
                   bytes, cudaGetErrorString(err));
      return false;
    }
    return true;
  }
  void UnregisterHost(void* data) override {
    cudaSetDevice(device_);
    if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
  }

 private:
  struct Opened {
    void* ptr = nullptr;
    int32_t refs = 0;
  };
  const int device_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Opened> open_ ABSL_GUARDED_BY(mu_);  // by handle bytes
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendOptions& options)
      : options_(options), geo_(options.geometry), region_device_(options.device) {}

  ~CudaBackend() override {
    cudaSetDevice(options_.device);
    for (cudaStream_t st : {copy_in_, compute_, copy_out_}) {
      if (st != nullptr) cudaStreamSynchronize(st);
    }
    ring_.reset();  // its buffers and events, before the streams go
    for (cudaStream_t st : {copy_in_, compute_, copy_out_}) {
      if (st != nullptr) cudaStreamDestroy(st);
    }
    const void* device_ptrs[] = {k_pool_, v_pool_, d_part_o_, d_part_lse_, d_counters_, d_k_scales_,
                                 d_v_scales_};
    for (const void* p : device_ptrs) cudaFree(const_cast<void*>(p));
  }

  absl::Status Init();

  std::string Name() const override { return "cuda"; }
  std::string Device() const override { return device_name_; }
  MemoryUsage Memory() const override { return memory_; }
  const KvGeometry& Geometry() const override { return geo_; }

  // Outputs of at least kDirectOutputBytes get a pinned buffer the download
  // lands in (no unpack copy); smaller ones cost less to unpack from staging
  // than to download one by one, and come from the heap.
  HostBuffer AllocateOutput(int64_t bytes) override {
    if (bytes >= kDirectOutputBytes && output_pool_ != nullptr) return output_pool_->Get(bytes);
    return HeapBuffer(bytes);
  }

  RegionDevice* region_device() override { return &region_device_; }

  int PipelineDepth() const override { return StagingRing::kSlots; }
  absl::Status Submit(absl::Span<const PrefillTask> tasks, BatchStats* stats) override;
  absl::Status Complete(BatchStats* stats) override;
  absl::Status WriteKv(const KvRows& rows, BatchStats* stats) override { return CopyRows(rows, true, stats); }
  absl::Status ReadKv(const KvRows& rows, BatchStats* stats) override { return CopyRows(rows, false, stats); }
  // On the device: only the page ids cross PCIe, not the zeros.
  absl::Status ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) override;
  // One layer's scales copied to the device arrays the kernels read.
  absl::Status SetKvScales(int32_t layer, absl::Span<const float> k_scales,
                           absl::Span<const float> v_scales) override;
  // MergeStates of host tensors stays on the CPU: a GPU pass would move every
  // byte over PCIe (tens of GB/s, after a copy into pinned staging) where the
  // CPU reads it once at memory speed. States in CUDA regions merge on the
  // GPU (MergeStatesOnDevice).
  absl::Status MergeStates(const MergeStatesParams& params, const MergeOnDevice& on_device) override;

 private:
  // Queues one packed batch's upload, kernels and download on the streams.
  absl::Status Launch(absl::Span<const PrefillTask> tasks, const PackedBatch& b, StagingRing::Slot& slot);
  // WriteKv (scatter) and ReadKv (gather), in chunks of the staging.
  absl::Status CopyRows(const KvRows& rows, bool scatter, BatchStats* stats);
  // Packs slots / k / v of rows [begin, begin + n) of `rows` for WriteKv.
  absl::Status CopyRowsChunk(const KvRows& rows, int64_t begin, int64_t n, bool scatter,
                             float* seconds);
  // FailedPrecondition unless no batch is in flight (WriteKv / ReadKv use
  // the idle slot's staging and the compute stream synchronously).
  absl::Status CheckIdle();
  // MergeStates with every tensor in device memory: the merge kernel reads
  // the states where they are (a peer's memory over NVLink) and writes the
  // outputs there.
  absl::Status MergeOnGpu(const MergeStatesParams& params);
  // Any other mix of host and device tensors (or more states than one launch
  // takes, or addresses the kernel's 16-byte loads cannot use): device
  // tensors are copied to host memory, merged by the CPU, and copied back.
  absl::Status MergeThroughHost(const MergeStatesParams& params, const MergeOnDevice& on_device);

  BackendOptions options_;
  KvGeometry geo_;
  CudaRegionDevice region_device_;
  std::string device_name_;
  MemoryUsage memory_;  // read once Init has allocated everything
  int64_t max_append_ = 0;
  // Pinned response buffers (AllocateOutput), at most the size class of one
  // batch's output staging in all; blocks are pinned on first use and then
  // recycled.
  static constexpr int64_t kDirectOutputBytes = SizeClassPool::kMinClass;
  std::shared_ptr<SizeClassPool> output_pool_;

  void* k_pool_ = nullptr;
  void* v_pool_ = nullptr;
  float* d_part_o_ = nullptr;
  float* d_part_lse_ = nullptr;
  int32_t* d_counters_ = nullptr;  // decode split tiles; zero between launches
  // FP8 pools: (num_layers, num_kv_heads) K and V scales (null otherwise).
  float* d_k_scales_ = nullptr;
  float* d_v_scales_ = nullptr;

  std::optional<BatchPacker> packer_;  // used by Submit's thread only
  std::unique_ptr<StagingRing> ring_;
  cudaStream_t copy_in_ = nullptr;
  cudaStream_t compute_ = nullptr;
  cudaStream_t copy_out_ = nullptr;
};

absl::Status CudaBackend::Init() {
  if (geo_.IsMla()) {
    return absl::InvalidArgumentError(
        "--attention=mla: the CUDA backend has no MLA kernel family yet; start the server with "
        "--backend=cpu (docs/design.md, \"Multi-head latent attention\")");
  }
  const int count = CudaDeviceCount();
  if (count == 0) return absl::FailedPreconditionError("no CUDA device is visible");
  if (options_.device < 0 || options_.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", options_.device, " out of range: ", count, " CUDA device(s) visible"));
  }
  const KvGeometry& g = geo_;
  if (!IsSupportedHeadDim(g.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim ", g.head_dim, " not supported by the CUDA backend (", kSupportedHeadDims, ")"));
  }
  if (g.num_kv_heads <= 0 || g.num_qo_heads % g.num_kv_heads != 0 || g.num_layers <= 0 ||
      g.num_pages <= 0 || g.page_size <= 0) {
    return absl::InvalidArgumentError("invalid KV geometry");
  }
  if (g.SlotsPerLayer() >= (int64_t{1} << 31)) {
    return absl::InvalidArgumentError("num_pages * page_size must stay below 2^31 per layer");
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  cudaDeviceProp prop;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options_.device));
  if (prop.major < 8) {
    return absl::FailedPreconditionError(
        absl::StrCat(prop.name, " has compute capability ", prop.major, ".", prop.minor, "; 8.0+ needed"));
  }
  device_name_ = absl::StrCat(prop.name, " (device ", options_.device, ")");
  if (!PrefillFamilyRunsOn(options_.prefill_family, PrefillDevice{prop.major, prop.minor})) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--prefill_kernel=", PrefillFamilyName(options_.prefill_family), " needs a Hopper GPU (compute capability 9.x); ",
        prop.name, " has ", prop.major, ".", prop.minor, " (use --prefill_kernel=auto or sm80)"));
  }

  // What the packer plans with: the device, each kernel's occupancy, and the
  // batch sizes the staging holds.
  PackerLimits lim;
  lim.num_sms = prop.multiProcessorCount;
  lim.device = PrefillDevice{prop.major, prop.minor};
  lim.family = options_.prefill_family;
  int32_t max_ctas = 1, min_tile = INT32_MAX, max_tile = 0;
  for (int k = 0; k < kNumPrefillKernels; ++k) {
    const auto kernel = static_cast<PrefillKernel>(k);
    lim.ctas_per_sm[k] = PrefillCtasPerSm(kernel, g.head_dim, g.dtype);
    max_ctas = std::max(max_ctas, lim.ctas_per_sm[k]);
    min_tile = std::min(min_tile, PrefillTileRows(kernel, g.head_dim));
    max_tile = std::max(max_tile, PrefillTileRows(kernel, g.head_dim));
  }
  cudaGetLastError();
  const int64_t group = g.num_qo_heads / g.num_kv_heads;
  lim.max_rows = std::max<int64_t>(options_.max_batch_rows, 1);
  lim.max_indices = std::max<int64_t>(options_.max_batch_kv_indices, 1);
  lim.max_append = max_append_ = std::max<int64_t>(options_.max_batch_append_rows, 1024);
  lim.max_partial_pairs = std::max<int64_t>(int64_t{4} * lim.num_sms * max_ctas * max_tile, 1 << 16);
  lim.max_items = g.num_kv_heads * (lim.max_rows * group / min_tile + lim.max_rows + 1) + 2 * lim.max_partial_pairs;
  // Decode family (--decode_kernel): unsplit items are at most one per (KV
  // head, 16-row tile) plus one per sequence; split ones add a partial slot
  // each.
  lim.decode = options_.decode_kernel && DecodeGeometrySupported(g);
  lim.decode_ctas_per_sm[0] = DecodeCtasPerSm(g.head_dim, g.dtype, 16, g.kv_fp8);
  lim.decode_ctas_per_sm[1] = DecodeCtasPerSm(g.head_dim, g.dtype, DecodeMaxTileRows(g.head_dim), g.kv_fp8);
  lim.decode_max_cluster[0] = DecodeMaxCluster(g.head_dim, g.dtype, 16, g.kv_fp8);
  lim.decode_max_cluster[1] = DecodeMaxCluster(g.head_dim, g.dtype, DecodeMaxTileRows(g.head_dim), g.kv_fp8);
  cudaGetLastError();
  const int64_t decode_slots = DecodePartialSlots(lim, g.head_dim);
  lim.max_decode_items = g.num_kv_heads * (lim.max_rows * group / 16 + lim.max_rows + 1) + decode_slots;
  // FP8 pools cut sequences into pieces of 8 rows (CutForDecode): one more
  // tile per piece at most.
  if (g.KvIsFp8()) lim.max_decode_items += g.num_kv_heads * (lim.max_rows / kMaxDecodeQueryRows + 1);
  packer_.emplace(g, lim);

  const int64_t pool_bytes = g.PoolBytes();
  ATTN_RETURN_IF_ERROR(DeviceAlloc(&k_pool_, pool_bytes, "the K pool", options_.device));
  ATTN_RETURN_IF_ERROR(DeviceAlloc(&v_pool_, pool_bytes, "the V pool", options_.device));
  // FP8 pools' scales, (num_layers, num_kv_heads) each, 1.0 until
  // SetKvScales (which copies one layer's at a time).
  if (g.KvIsFp8()) {
    const int64_t n = int64_t{g.num_layers} * g.num_kv_heads;
    const std::vector<float> ones(static_cast<size_t>(n), 1.f);
    for (float** scales : {&d_k_scales_, &d_v_scales_}) {
      ATTN_RETURN_IF_ERROR(DeviceAlloc(reinterpret_cast<void**>(scales), n * 4, "the KV scales",
                                       options_.device));
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(*scales, ones.data(), n * 4, cudaMemcpyHostToDevice));
    }
  }
  // Poison-proof: a fresh page reads zeros, never stale data.
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemset(k_pool_, 0, pool_bytes));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemset(v_pool_, 0, pool_bytes));
  ATTN_RETURN_IF_ERROR(DeviceAlloc(reinterpret_cast<void**>(&d_part_o_),
                                   lim.max_partial_pairs * g.head_dim * 4, "split partials", options_.device));
  ATTN_RETURN_IF_ERROR(DeviceAlloc(reinterpret_cast<void**>(&d_part_lse_), lim.max_partial_pairs * 4,
                                   "split LSEs", options_.device));
  ATTN_RETURN_IF_ERROR(DeviceAlloc(reinterpret_cast<void**>(&d_counters_), decode_slots * 4,
                                   "decode split counters", options_.device));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemset(d_counters_, 0, decode_slots * 4));  // once: the kernel leaves them 0
  ring_ = std::make_unique<StagingRing>();
  ATTN_RETURN_IF_ERROR(ring_->Init(packer_->InputCapacity(), packer_->OutputCapacity(), options_.device));
  for (cudaStream_t* stream : {&copy_in_, &compute_, &copy_out_}) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(stream, cudaStreamNonBlocking));
  }
  SizeClassPool::Allocator pinned;
  pinned.allocate = [](int64_t bytes) -> void* {
    void* p = nullptr;
    // Portable: pinned for every context, whichever thread allocates it.
    if (cudaHostAlloc(&p, static_cast<size_t>(bytes), cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  };
  pinned.free = [](void* p) { cudaFreeHost(p); };
  pinned.pinned = true;
  // Bounded by the size class of a full batch's output (not its exact size):
  // the largest response a request may get then still comes from the pool,
  // pinned and reused, instead of pageable memory allocated per request.
  output_pool_ = SizeClassPool::Create(std::move(pinned), SizeClassPool::ClassBytes(ring_->out_capacity()));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  size_t free_bytes = 0, total_bytes = 0;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  memory_.used_bytes = static_cast<int64_t>(total_bytes - free_bytes);
  memory_.total_bytes = static_cast<int64_t>(total_bytes);
  return absl::OkStatus();
}

absl::Status CudaBackend::CheckIdle() {
  if (const int n = ring_->InFlight(); n != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(n, " batch(es) in flight: KV reads and writes need an idle backend"));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Submit(absl::Span<const PrefillTask> tasks, BatchStats* stats) {
  const absl::Time start = absl::Now();
  ATTN_ASSIGN_OR_RETURN(StagingRing::Slot* slot, ring_->NextFree());
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  PackedBatch b;
  ATTN_RETURN_IF_ERROR(packer_->Pack(tasks, slot->h_in, ring_->in_capacity(), &b));
  if (absl::Status launched = Launch(tasks, b, *slot); !launched.ok()) {
    // Work queued before the failure reads this slot: wait for it (the device
    // is probably lost; the scheduler's fault handler marks the server
    // unhealthy) so the slot is never reused under it.
    for (cudaStream_t st : {copy_in_, compute_, copy_out_}) cudaStreamSynchronize(st);
    return launched;
  }
  slot->outputs.clear();
  for (const PrefillTask& t : tasks) {
    slot->outputs.push_back({t.o, t.lse, t.total_q, t.o_on_device || t.out_pinned,
                             t.lse_on_device || t.out_pinned});
  }
  slot->off_lse = b.off_lse;
  slot->appended = b.num_append > 0;
  slot->attention_launches = (b.num_decode_items > 0 ? 1 : 0) + (b.num_items > 0 ? 1 : 0);
  slot->decoded = b.num_decode_items > 0;
  slot->merged = b.num_merges > 0;
  ring_->Commit();
  if (stats != nullptr) stats->submit_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  return absl::OkStatus();
}

absl::Status CudaBackend::Launch(absl::Span<const PrefillTask> tasks, const PackedBatch& b,
                                 StagingRing::Slot& slot) {
  const KvGeometry& g = geo_;
  const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim * g.QElemBytes();
  const int64_t lse_row = int64_t{g.num_qo_heads} * 4;
  uint8_t* const d_in = slot.d_in;
  cudaEvent_t* const ev = slot.events;
  // Upload (copy-in stream); appends, one attention launch per family, a
  // merge if the prefill family split (compute stream); one download
  // (copy-out stream).
  // Inputs in CUDA regions are copied device to device into their holes of
  // d_in (peer copies when the region is on another GPU).
  if (b.upload_end > b.upload_begin) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_in + b.upload_begin, slot.h_in + b.upload_begin,
                                                   b.upload_end - b.upload_begin, cudaMemcpyHostToDevice,
                                                   copy_in_));
  }
  for (const PackedBatch::DeviceCopy& c : b.device_in) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_in + c.dst, c.src, c.bytes, cudaMemcpyDefault, copy_in_));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kUploaded], copy_in_));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, ev[Ev::kUploaded], 0));
  if (b.num_append > 0) {
    // The geo.dtype rows (quantized into an FP8 pool), then the FP8 rows as
    // stored: distinct slots, so the two launches never touch one row.
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kAppendBegin], compute_));
    const int64_t n_half = b.num_append - b.num_append_fp8;
    for (const bool fp8 : {false, true}) {
      const int64_t n = fp8 ? b.num_append_fp8 : n_half;
      if (n == 0) continue;
      AppendKvParams ap;
      ap.k_cache = k_pool_;
      ap.v_cache = v_pool_;
      ap.k = d_in + (fp8 ? b.off_k8 : b.off_k);
      ap.v = d_in + (fp8 ? b.off_v8 : b.off_v);
      ap.slots = reinterpret_cast<const int64_t*>(d_in + b.off_slots) + (fp8 ? n_half : 0);
      ap.n = n;
      ap.layer = 0;  // slots are layer-global
      ap.geo = g;
      ap.rows_fp8 = fp8;
      ap.k_scales = d_k_scales_;
      ap.v_scales = d_v_scales_;
      ATTNSERVE_CUDA_RETURN_IF_ERROR(AppendKvCuda(ap, compute_));
    }
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kAppendEnd], compute_));
  }
  PagedPrefillParams pp;
  pp.q = d_in + b.off_q;
  pp.o = slot.d_out;
  pp.lse = reinterpret_cast<float*>(slot.d_out + b.off_lse);
  pp.k_cache = k_pool_;
  pp.v_cache = v_pool_;
  pp.k_scales = d_k_scales_;
  pp.v_scales = d_v_scales_;
  pp.kv_indices = reinterpret_cast<const int32_t*>(d_in + b.off_idx);
  pp.seqs = reinterpret_cast<const PrefillSeq*>(d_in + b.off_seqs);
  pp.sinks = b.num_sink_sets > 0 ? reinterpret_cast<const float*>(d_in + b.off_sinks) : nullptr;
  pp.any_soft_cap = b.any_soft_cap;
  pp.num_seqs = b.num_seqs;
  pp.total_q = static_cast<int32_t>(b.total_q);
  pp.geo = g;
  ATTN_RETURN_IF_ERROR(LaunchAttention(pp, b, d_in, AttentionWorkspace{d_part_o_, d_part_lse_, d_counters_},
                                       compute_, ev));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kComputed], compute_));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_out_, ev[Ev::kComputed], 0));
  // Outputs in pinned host memory (response buffers, page-locked system
  // regions) or in device memory (CUDA regions) are copied straight into
  // them; the rest go through the slot's staging and Complete unpacks them.
  bool staged = false;
  int64_t row = 0;
  for (const PrefillTask& t : tasks) {
    if (t.total_q > 0) {
      if (t.o_on_device || t.out_pinned) {
        ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(t.o, slot.d_out + row * q_row, size_t(t.total_q) * q_row,
                                                       cudaMemcpyDefault, copy_out_));
      } else {
        staged = true;
      }
      if (t.lse_on_device || t.out_pinned) {
        ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(t.lse, slot.d_out + b.off_lse + row * lse_row,
                                                       size_t(t.total_q) * lse_row, cudaMemcpyDefault,
                                                       copy_out_));
      } else {
        staged = true;
      }
    }
    row += t.total_q;
  }
  if (staged) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot.h_out, slot.d_out, b.out_bytes, cudaMemcpyDeviceToHost, copy_out_));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kDownloaded], copy_out_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Complete(BatchStats* stats) {
  ATTN_ASSIGN_OR_RETURN(StagingRing::Slot* slot, ring_->Oldest());
  const absl::Time start = absl::Now();
  cudaError_t err = cudaSetDevice(options_.device);
  if (err == cudaSuccess) err = cudaEventSynchronize(slot->events[Ev::kDownloaded]);
  if (err != cudaSuccess) {
    ring_->Release();
    return absl::InternalError(absl::StrCat("waiting for a batch: ", cudaGetErrorName(err), " (",
                                            cudaGetErrorString(err), ")"));
  }
  const absl::Time downloaded = absl::Now();

  // Outputs back to each task.
  const int64_t q_row = int64_t{geo_.num_qo_heads} * geo_.head_dim * geo_.QElemBytes();
  const int64_t lse_row = int64_t{geo_.num_qo_heads} * 4;
  int64_t row = 0;
  for (const StagingRing::Slot::Output& out : slot->outputs) {
    if (out.rows > 0 && !out.o_direct) CopyBytes(out.o, slot->h_out + row * q_row, int64_t{out.rows} * q_row);
    if (out.rows > 0 && !out.lse_direct) {
      std::memcpy(out.lse, slot->h_out + slot->off_lse + row * lse_row, size_t(out.rows) * lse_row);
    }
    row += out.rows;
  }
  const absl::Time unpacked = absl::Now();
  // Kernel times, read while the slot (and its events) is still ours.
  BatchStats t;
  float ms = 0;
  auto elapsed = [&](int begin, int end) {
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, slot->events[begin], slot->events[end]);
    return err == cudaSuccess ? ms * 1e-3 : 0.0;
  };
  if (slot->appended) {
    t.append_launches = 1;
    t.append_seconds = elapsed(Ev::kAppendBegin, Ev::kAppendEnd);
  }
  if (slot->attention_launches > 0) {
    t.attention_launches = slot->attention_launches;
    t.attention_seconds = elapsed(Ev::kAttnBegin, Ev::kAttnEnd);
  }
  if (slot->decoded) {
    t.attention_decode_launches = 1;
    t.attention_decode_seconds = elapsed(Ev::kAttnBegin, Ev::kDecodeEnd);
  }
  if (slot->merged) {
    t.merge_launches = 1;
    t.merge_seconds = elapsed(Ev::kMergeBegin, Ev::kMergeEnd);
  }
  ring_->Release();
  if (stats != nullptr) {
    stats->Add(t);
    stats->wait_seconds += absl::ToDoubleSeconds(downloaded - start);
    stats->unpack_seconds += absl::ToDoubleSeconds(unpacked - downloaded);
  }
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("timing a batch: ", cudaGetErrorName(err)));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyRowsChunk(const KvRows& rows, int64_t begin, int64_t n, bool scatter,
                                        float* seconds) {
  // Bytes of a row as the request carries it: stored (a 16-bit pool, FP8
  // rows), or geo.dtype values quantized or dequantized on the device.
  const int64_t rb = !geo_.KvIsFp8() || rows.rows_fp8 ? geo_.KvRowBytes()
                                                      : geo_.RowElems() * geo_.QElemBytes();
  StagingRing::Slot& slot = ring_->IdleSlot();
  StagingPacker in(slot.h_in, ring_->in_capacity());
  const int64_t off_slots = in.Take(n * 8);
  const int64_t off_k = in.Take(n * rb);
  const int64_t off_v = in.Take(n * rb);
  if (off_slots < 0 || off_k < 0 || off_v < 0) return absl::InternalError("KV staging overflow");
  std::memcpy(in.At(off_slots), rows.slots + begin, n * 8);
  // k and v: host rows through the pinned staging (one upload with the
  // slots when both are host), device rows (CUDA regions) device to device.
  // A WriteKV's inline rows that arrived in pieces are gathered into the
  // staging (their one host copy; the pointer is null then).
  uint8_t* const k_at = rows.k == nullptr ? nullptr : static_cast<uint8_t*>(rows.k) + begin * rb;
  uint8_t* const v_at = rows.v == nullptr ? nullptr : static_cast<uint8_t*>(rows.v) + begin * rb;
  const bool any_device = rows.k_on_device || rows.v_on_device;
  if (scatter) {
    for (auto [off, at, on_device, scattered] :
         {std::tuple{off_k, k_at, rows.k_on_device, &rows.k_scattered},
          std::tuple{off_v, v_at, rows.v_on_device, &rows.v_scattered}}) {
      if (on_device) continue;
      if (!scattered->empty()) {
        CopyOut(*scattered, begin * rb, n * rb, in.At(off));
      } else {
        CopyBytes(in.At(off), at, n * rb);
      }
    }
  }
  const int64_t upload = scatter && !any_device ? in.used() : n * 8;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.d_in, slot.h_in, upload, cudaMemcpyHostToDevice, compute_));
  if (scatter && any_device) {
    for (auto [off, at, on_device] : {std::tuple{off_k, k_at, rows.k_on_device}, std::tuple{off_v, v_at, rows.v_on_device}}) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.d_in + off, on_device ? at : in.At(off), n * rb,
                                                     on_device ? cudaMemcpyDefault : cudaMemcpyHostToDevice,
                                                     compute_));
    }
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.events[StagingRing::kAppendBegin], compute_));
  if (scatter) {
    AppendKvParams ap;
    ap.k_cache = k_pool_;
    ap.v_cache = v_pool_;
    ap.k = slot.d_in + off_k;
    ap.v = slot.d_in + off_v;
    ap.slots = reinterpret_cast<const int64_t*>(slot.d_in + off_slots);
    ap.n = n;
    ap.layer = rows.layer;
    ap.geo = geo_;
    ap.rows_fp8 = rows.rows_fp8;
    ap.k_scales = d_k_scales_;
    ap.v_scales = d_v_scales_;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(AppendKvCuda(ap, compute_));
  } else {
    GatherKvParams gp;
    gp.k_cache = k_pool_;
    gp.v_cache = v_pool_;
    gp.k = slot.d_in + off_k;
    gp.v = slot.d_in + off_v;
    gp.slots = reinterpret_cast<const int64_t*>(slot.d_in + off_slots);
    gp.n = n;
    gp.layer = rows.layer;
    gp.geo = geo_;
    gp.dequantize = geo_.KvIsFp8() && !rows.rows_fp8;
    gp.k_scales = d_k_scales_;
    gp.v_scales = d_v_scales_;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(GatherKvCuda(gp, compute_));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.events[StagingRing::kAppendEnd], compute_));
  if (!scatter && !any_device) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot.h_in + off_k, slot.d_in + off_k, off_v + n * rb - off_k, cudaMemcpyDeviceToHost, compute_));
  } else if (!scatter) {
    for (auto [off, at, on_device] : {std::tuple{off_k, k_at, rows.k_on_device}, std::tuple{off_v, v_at, rows.v_on_device}}) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(on_device ? at : in.At(off), slot.d_in + off, n * rb,
                                                     on_device ? cudaMemcpyDefault : cudaMemcpyDeviceToHost,
                                                     compute_));
    }
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  if (!scatter) {
    if (!rows.k_on_device) CopyBytes(k_at, in.At(off_k), n * rb);
    if (!rows.v_on_device) CopyBytes(v_at, in.At(off_v), n * rb);
  }
  float ms = 0;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, slot.events[StagingRing::kAppendBegin], slot.events[StagingRing::kAppendEnd]));
  *seconds += ms * 1e-3f;
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyRows(const KvRows& rows, bool scatter, BatchStats* stats) {
  if (absl::Status st = CheckIdle(); !st.ok()) return st;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  float seconds = 0;
  int32_t launches = 0;
  for (int64_t begin = 0; begin < rows.n; begin += max_append_) {
    const int64_t n = std::min(max_append_, rows.n - begin);
    ATTN_RETURN_IF_ERROR(CopyRowsChunk(rows, begin, n, scatter, &seconds));
    ++launches;
  }
  if (stats != nullptr) {
    stats->kv_rows_launches += launches;
    stats->kv_rows_seconds += seconds;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::MergeStates(const MergeStatesParams& params, const MergeOnDevice& on_device) {
  if (!on_device.any()) {
    MergeStatesCpu(params);
    return absl::OkStatus();
  }
  if (absl::Status st = CheckIdle(); !st.ok()) return st;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  bool all_device = on_device.v_out && on_device.lse_out &&
                    on_device.v.size() == size_t(params.num_states) &&
                    on_device.lse.size() == size_t(params.num_states);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool fits = params.num_states <= kMaxMergeStatesPerLaunch && aligned(params.v_out);
  for (int32_t i = 0; i < params.num_states && all_device; ++i) {
    all_device = on_device.v[i] && on_device.lse[i];
    fits = fits && aligned(params.v[i]);
  }
  if (all_device && fits) return MergeOnGpu(params);
  return MergeThroughHost(params, on_device);
}

absl::Status CudaBackend::MergeOnGpu(const MergeStatesParams& params) {
  if (params.n == 0) return absl::OkStatus();
  ATTNSERVE_CUDA_RETURN_IF_ERROR(MergeStatesCuda(params, compute_));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  return absl::OkStatus();
}

absl::Status CudaBackend::MergeThroughHost(const MergeStatesParams& params, const MergeOnDevice& on_device) {
  const int64_t rows = params.n * params.h;
  const size_t v_bytes = size_t(rows) * params.d * KvDTypeBytes(params.dtype);  // 16-bit states
  const size_t lse_bytes = size_t(rows) * sizeof(float);
  auto is_device = [](const std::vector<bool>& flags, int32_t i) { return size_t(i) < flags.size() && flags[i]; };
  std::vector<std::vector<uint8_t>> copies;  // host copies of device tensors
  std::vector<const void*> v(params.v, params.v + params.num_states);
  std::vector<const float*> lse(params.lse, params.lse + params.num_states);
  auto to_host = [&](const void* src, size_t bytes) -> absl::StatusOr<const void*> {
    copies.emplace_back(bytes);
    if (bytes > 0) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(copies.back().data(), src, bytes, cudaMemcpyDefault));
    }
    return copies.back().data();
  };
  for (int32_t i = 0; i < params.num_states; ++i) {
    if (is_device(on_device.v, i)) { ATTN_ASSIGN_OR_RETURN(v[i], to_host(params.v[i], v_bytes)); }
    if (is_device(on_device.lse, i)) {
      ATTN_ASSIGN_OR_RETURN(const void* l, to_host(params.lse[i], lse_bytes));
      lse[i] = static_cast<const float*>(l);
    }
  }
  std::vector<uint8_t> v_out(on_device.v_out ? v_bytes : 0), lse_out(on_device.lse_out ? lse_bytes : 0);
  MergeStatesParams host = params;
  host.v = v.data();
  host.lse = lse.data();
  if (on_device.v_out) host.v_out = v_out.data();
  if (on_device.lse_out) host.lse_out = reinterpret_cast<float*>(lse_out.data());
  MergeStatesCpu(host);
  if (on_device.v_out && v_bytes > 0) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(params.v_out, v_out.data(), v_bytes, cudaMemcpyDefault));
  }
  if (on_device.lse_out && lse_bytes > 0) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpy(params.lse_out, lse_out.data(), lse_bytes, cudaMemcpyDefault));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) {
  if (absl::Status st = CheckIdle(); !st.ok()) return st;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  StagingRing::Slot& slot = ring_->IdleSlot();
  const int64_t per_launch = ring_->in_capacity() / 4;
  float seconds = 0;
  int32_t launches = 0;
  for (size_t begin = 0; begin < pages.size(); begin += per_launch) {
    const int64_t n = std::min<int64_t>(per_launch, static_cast<int64_t>(pages.size() - begin));
    std::memcpy(slot.h_in, pages.data() + begin, n * 4);
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot.d_in, slot.h_in, n * 4, cudaMemcpyHostToDevice, compute_));
    ZeroPagesParams zp;
    zp.k_cache = k_pool_;
    zp.v_cache = v_pool_;
    zp.pages = reinterpret_cast<const int32_t*>(slot.d_in);
    zp.num_pages_listed = n;
    zp.geo = geo_;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.events[StagingRing::kAppendBegin], compute_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(ZeroPagesCuda(zp, compute_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.events[StagingRing::kAppendEnd], compute_));
    // The next chunk reuses the staging: wait for this one.
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
    float ms = 0;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(&ms, slot.events[StagingRing::kAppendBegin], slot.events[StagingRing::kAppendEnd]));
    seconds += ms / 1e3f;
    ++launches;
  }
  if (stats != nullptr) {
    stats->zero_launches += launches;
    stats->zero_seconds += seconds;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::SetKvScales(int32_t layer, absl::Span<const float> k_scales,
                                      absl::Span<const float> v_scales) {
  if (!geo_.KvIsFp8()) {
    return absl::FailedPreconditionError("KV scales apply to an FP8 KV cache only");
  }
  const size_t heads = static_cast<size_t>(geo_.num_kv_heads);
  if (layer < 0 || layer >= geo_.num_layers || k_scales.size() != heads || v_scales.size() != heads) {
    return absl::InvalidArgumentError("SetKvScales: a layer out of range or not num_kv_heads scales");
  }
  if (absl::Status st = CheckIdle(); !st.ok()) return st;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  // Through the idle slot's pinned staging, on the compute stream: ordered
  // after every batch and write before it.
  StagingRing::Slot& slot = ring_->IdleSlot();
  std::memcpy(slot.h_in, k_scales.data(), heads * 4);
  std::memcpy(slot.h_in + heads * 4, v_scales.data(), heads * 4);
  const int64_t at = int64_t{layer} * geo_.num_kv_heads;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_k_scales_ + at, slot.h_in, heads * 4,
                                                 cudaMemcpyHostToDevice, compute_));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_v_scales_ + at, slot.h_in + heads * 4,
                                                 heads * 4, cudaMemcpyHostToDevice, compute_));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendOptions& options) {
  auto backend = std::make_unique<CudaBackend>(options);
  absl::Status st = backend->Init();
  if (!st.ok()) return st;  // the destructor frees whatever was allocated
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace attnserve
