// CudaBackend: paged KV pools in device memory and the batched attention path.
// Everything is allocated in Create(); Submit / Complete / WriteKv / ReadKv
// only pack into pinned staging, copy, launch and copy back.
//
// Pipeline: kSlots staging slots, each a pinned input buffer and its device
// mirror plus a device output buffer and its pinned mirror. A batch in slot s
// is uploaded on the copy-in stream, computed on the compute stream (after
// the upload's event) and downloaded on the copy-out stream (after the
// compute's event), so batch N+1's upload and batch N-1's download overlap
// batch N's kernels. The compute stream runs batches in submission order, so
// a batch's appends never race another batch's attention. Split partials are
// only touched on the compute stream and are shared by all slots.
#include "server/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kernels/append_kv_cuda.h"
#include "kernels/paged_prefill_cuda.h"

namespace attnserve {

// Evaluates a CUDA call; on failure returns absl::InternalError naming it.
#define ATTNSERVE_CUDA_RETURN_IF_ERROR(expr)                                   \
  do {                                                                         \
    const cudaError_t cuda_err_ = (expr);                                      \
    if (cuda_err_ != cudaSuccess) {                                            \
      return absl::InternalError(absl::StrCat(#expr, ": ", cudaGetErrorName(cuda_err_), \
                                              " (", cudaGetErrorString(cuda_err_), ")")); \
    }                                                                          \
  } while (0)

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear; "no driver" is not an error here
    return 0;
  }
  return n;
}

namespace {

constexpr int64_t kAlign = 256;
constexpr int32_t kMinChunk = 512;

int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Bump allocator over one staging buffer: the same offsets address the
// pinned host copy and its device mirror, so one copy moves everything.
class Packer {
 public:
  Packer(uint8_t* host, int64_t capacity) : host_(host), capacity_(capacity) {}
  // Reserves bytes; returns the offset or -1 when it does not fit.
  int64_t Take(int64_t bytes) {
    const int64_t off = AlignUp(used_);
    if (off + bytes > capacity_) return -1;
    used_ = off + bytes;
    return off;
  }
  uint8_t* At(int64_t off) const { return host_ + off; }
  int64_t used() const { return used_; }

 private:
  uint8_t* host_;
  int64_t capacity_;
  int64_t used_ = 0;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendOptions& options) : options_(options), geo_(options.geometry) {}

  ~CudaBackend() override {
    cudaSetDevice(options_.device);
    for (cudaStream_t st : {copy_in_, compute_, copy_out_}) {
      if (st != nullptr) cudaStreamSynchronize(st);
    }
    for (Slot& slot : slots_) {
      for (cudaEvent_t e : slot.events) {
        if (e != nullptr) cudaEventDestroy(e);
      }
      cudaFree(slot.d_in);
      cudaFree(slot.d_out);
      cudaFreeHost(slot.h_in);
      cudaFreeHost(slot.h_out);
    }
    for (cudaStream_t st : {copy_in_, compute_, copy_out_}) {
      if (st != nullptr) cudaStreamDestroy(st);
    }
    const void* device_ptrs[] = {k_pool_, v_pool_, d_part_o_, d_part_lse_};
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

  int PipelineDepth() const override { return kSlots; }
  absl::Status Submit(absl::Span<const PrefillTask> tasks, BatchStats* stats) override;
  absl::Status Complete(BatchStats* stats) override;
  absl::Status WriteKv(const KvRows& rows, BatchStats* stats) override;
  absl::Status ReadKv(const KvRows& rows) override;
  // On the device: only the page ids cross PCIe, not the zeros.
  absl::Status ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) override;
  // MergeStates stays on the CPU default: its inputs and outputs live in host
  // memory, so a GPU pass would move every byte over PCIe (tens of GB/s, after
  // a copy into pinned staging) where the CPU reads it once at memory speed.

 private:
  absl::Status Alloc(void** p, int64_t bytes, const char* what);
  absl::Status AllocHost(void** p, int64_t bytes, const char* what);
  // Packs slots / k / v of rows [begin, begin + n) of `rows` for WriteKv.
  absl::Status CopyRowsChunk(const KvRows& rows, int64_t begin, int64_t n, bool scatter,
                             float* seconds);
  // FailedPrecondition unless no batch is in flight (WriteKv / ReadKv use
  // slot 0's staging and the compute stream synchronously).
  absl::Status CheckIdle();

  BackendOptions options_;
  KvGeometry geo_;
  std::string device_name_;
  MemoryUsage memory_;  // read once Init has allocated everything
  int32_t num_sms_ = 0;
  // Kernel variants (paged_prefill_cuda.h): 0 = 128-row tiles, the prefill
  // path; 1 = 64-row tiles, picked when no sequence packs more than 64 rows
  // (decode), where it measured faster.
  int32_t ctas_per_sm_[2] = {1, 1};
  int32_t tile_rows_[2] = {128, 64};

  int64_t max_rows_ = 0;
  int64_t max_indices_ = 0;
  int64_t max_append_ = 0;
  int64_t max_items_ = 0;
  int64_t max_partial_pairs_ = 0;

  // Pinned response buffers (AllocateOutput), at most one batch's output
  // staging in all; blocks are pinned on first use and then recycled.
  static constexpr int64_t kDirectOutputBytes = SizeClassPool::kMinClass;
  std::shared_ptr<SizeClassPool> output_pool_;

  void* k_pool_ = nullptr;
  void* v_pool_ = nullptr;
  float* d_part_o_ = nullptr;
  float* d_part_lse_ = nullptr;
  int64_t in_capacity_ = 0;
  int64_t out_capacity_ = 0;

  // One batch's staging and what Complete needs to finish it.
  struct Slot {
    uint8_t* h_in = nullptr;   // pinned inputs, packed
    uint8_t* d_in = nullptr;   // their device mirror (same layout)
    uint8_t* d_out = nullptr;  // outputs: o, then lse at off_lse
    uint8_t* h_out = nullptr;  // pinned mirror of d_out
    // append begin/end, attention begin/end, merge begin/end, uploaded,
    // computed, downloaded.
    cudaEvent_t events[9] = {};
    // The batch in flight.
    struct Output {
      void* o;
      float* lse;
      int64_t rows;
      bool pinned;  // downloaded into o and lse directly, nothing to unpack
    };
    std::vector<Output> outputs;
    int64_t off_lse = 0;
    int64_t total_q = 0;
    bool appended = false, attended = false, merged = false;
  };
  static constexpr int kSlots = 2;
  enum { kAppendBegin, kAppendEnd, kAttnBegin, kAttnEnd, kMergeBegin, kMergeEnd, kUploaded,
         kComputed, kDownloaded };
  Slot slots_[kSlots];
  // Submitted batches occupy slots head_, head_ + 1, ... (mod kSlots).
  absl::Mutex ring_mu_;
  int head_ ABSL_GUARDED_BY(ring_mu_) = 0;
  int in_flight_ ABSL_GUARDED_BY(ring_mu_) = 0;

  cudaStream_t copy_in_ = nullptr;
  cudaStream_t compute_ = nullptr;
  cudaStream_t copy_out_ = nullptr;

  // Submit's scratch, reused between batches (Submit runs on one thread).
  PrefillPlan plan_;
  std::vector<PrefillSeq> seqs_;
  std::vector<std::pair<int32_t, int64_t>> append_rows_;  // (task, row)
  std::vector<int64_t> append_slots_;
  absl::flat_hash_map<int64_t, int64_t> last_append_;
};

absl::Status CudaBackend::Alloc(void** p, int64_t bytes, const char* what) {
  const cudaError_t err = cudaMalloc(p, std::max<int64_t>(bytes, 1));
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes of device memory for ",
                                                     what, " on device ", options_.device, " (", free_b,
                                                     " bytes free of ", total_b, ")"));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(err);
  return absl::OkStatus();
}

absl::Status CudaBackend::AllocHost(void** p, int64_t bytes, const char* what) {
  const cudaError_t err = cudaMallocHost(p, std::max<int64_t>(bytes, 1));
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of pinned host memory for ", what));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(err);
  return absl::OkStatus();
}

absl::Status CudaBackend::Init() {
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
  num_sms_ = prop.multiProcessorCount;
  for (int v = 0; v < 2; ++v) {
    tile_rows_[v] = PrefillTileRows(g.head_dim, v);
    ctas_per_sm_[v] = PrefillCtasPerSm(g.head_dim, g.dtype, v);
  }
  cudaGetLastError();
  const int32_t min_tile = std::min(tile_rows_[0], tile_rows_[1]);

  const int64_t H = g.num_qo_heads, D = g.head_dim, group = g.num_qo_heads / g.num_kv_heads;
  max_rows_ = std::max<int64_t>(options_.max_batch_rows, 1);
  max_indices_ = std::max<int64_t>(options_.max_batch_kv_indices, 1);
  max_append_ = std::max<int64_t>(options_.max_batch_append_rows, 1024);
  max_partial_pairs_ = std::max<int64_t>(
      int64_t{4} * num_sms_ * std::max(ctas_per_sm_[0], ctas_per_sm_[1]) * std::max(tile_rows_[0], tile_rows_[1]),
      1 << 16);
  max_items_ = g.num_kv_heads * (max_rows_ * group / min_tile + max_rows_ + 1) + 2 * max_partial_pairs_;
  const int64_t row_bytes = g.RowElems() * 2;

  in_capacity_ = AlignUp(max_rows_ * H * D * 2) + AlignUp(max_indices_ * 4) +
                 AlignUp(max_rows_ * int64_t{sizeof(PrefillSeq)}) +
                 AlignUp(max_items_ * int64_t{sizeof(PrefillWorkItem)}) +
                 AlignUp(max_rows_ * int64_t{sizeof(SplitMergeSeq)}) + AlignUp(max_append_ * 8) +
                 2 * AlignUp(max_append_ * row_bytes) + kAlign;
  out_capacity_ = AlignUp(max_rows_ * H * D * 2) + AlignUp(max_rows_ * H * 4) + kAlign;

  const int64_t pool_bytes = g.PoolElems() * 2;
  absl::Status st;
  if (!(st = Alloc(&k_pool_, pool_bytes, "the K pool")).ok()) return st;
  if (!(st = Alloc(&v_pool_, pool_bytes, "the V pool")).ok()) return st;
  // Poison-proof: a fresh page reads zeros, never stale data.
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemset(k_pool_, 0, pool_bytes));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemset(v_pool_, 0, pool_bytes));
  if (!(st = Alloc(reinterpret_cast<void**>(&d_part_o_), max_partial_pairs_ * D * 4, "split partials")).ok()) {
    return st;
  }
  if (!(st = Alloc(reinterpret_cast<void**>(&d_part_lse_), max_partial_pairs_ * 4, "split LSEs")).ok()) {
    return st;
  }
  for (Slot& slot : slots_) {
    if (!(st = Alloc(reinterpret_cast<void**>(&slot.d_in), in_capacity_, "input staging")).ok()) return st;
    if (!(st = Alloc(reinterpret_cast<void**>(&slot.d_out), out_capacity_, "output staging")).ok()) return st;
    if (!(st = AllocHost(reinterpret_cast<void**>(&slot.h_in), in_capacity_, "input staging")).ok()) return st;
    if (!(st = AllocHost(reinterpret_cast<void**>(&slot.h_out), out_capacity_, "output staging")).ok()) {
      return st;
    }
    for (cudaEvent_t& e : slot.events) ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  }
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
  output_pool_ = SizeClassPool::Create(std::move(pinned), out_capacity_);
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  plan_.items.reserve(1024);
  size_t free_bytes = 0, total_bytes = 0;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  memory_.used_bytes = static_cast<int64_t>(total_bytes - free_bytes);
  memory_.total_bytes = static_cast<int64_t>(total_bytes);
  return absl::OkStatus();
}

absl::Status CudaBackend::CheckIdle() {
  absl::MutexLock lock(&ring_mu_);
  if (in_flight_ != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(in_flight_, " batch(es) in flight: KV reads and writes need an idle backend"));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Submit(absl::Span<const PrefillTask> tasks, BatchStats* stats) {
  const absl::Time start = absl::Now();
  int s_index;
  {
    absl::MutexLock lock(&ring_mu_);
    if (in_flight_ >= kSlots) {
      return absl::FailedPreconditionError(
          absl::StrCat("the CUDA backend holds at most ", kSlots, " batches in flight"));
    }
    s_index = (head_ + in_flight_) % kSlots;
  }
  // The slot is free: its previous batch was completed (downloaded and
  // unpacked), so its staging may be overwritten.
  Slot& slot = slots_[s_index];
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  const KvGeometry& g = geo_;
  const int64_t H = g.num_qo_heads, D = g.head_dim;
  const int64_t row_elems = g.RowElems();

  // ---- Batch-global sequences (q_start / kv_start shifted); empty ones dropped.
  int64_t total_q = 0, total_idx = 0, total_append = 0;
  seqs_.clear();
  for (const PrefillTask& t : tasks) {
    for (const PrefillSeq& s : t.seqs) {
      if (s.q_len <= 0) continue;
      PrefillSeq b = s;
      b.q_start = static_cast<int32_t>(s.q_start + total_q);
      b.kv_start = static_cast<int32_t>(s.kv_start + total_idx);
      b.layer = t.layer;
      seqs_.push_back(b);
    }
    total_q += t.total_q;
    total_idx += t.num_kv_indices;
    total_append += t.num_append;
  }
  if (total_q > max_rows_ || total_q > INT32_MAX) {
    return absl::ResourceExhaustedError(absl::StrCat("batch has ", total_q, " query rows; the CUDA backend holds at most ", max_rows_));
  }
  if (total_idx > max_indices_) {
    return absl::ResourceExhaustedError(absl::StrCat("batch has ", total_idx, " kv indices; the CUDA backend holds at most ", max_indices_));
  }
  if (total_append > max_append_) {
    return absl::ResourceExhaustedError(absl::StrCat("batch appends ", total_append, " rows; the CUDA backend holds at most ", max_append_));
  }

  int64_t max_packed_rows = 0;
  for (const PrefillSeq& s : seqs_) {
    max_packed_rows = std::max<int64_t>(max_packed_rows, int64_t{s.q_len} * (g.num_qo_heads / g.num_kv_heads));
  }
  const int32_t variant = g.head_dim == 128 && max_packed_rows <= tile_rows_[1] ? 1 : 0;
  PrefillPlanOptions popt;
  popt.num_sms = num_sms_;
  popt.ctas_per_sm = ctas_per_sm_[variant];
  popt.min_chunk = kMinChunk;
  popt.max_partial_pairs = max_partial_pairs_;
  popt.tile_rows = tile_rows_[variant];
  BuildPrefillPlan(seqs_.data(), static_cast<int32_t>(seqs_.size()), g, popt, &plan_);
  if (static_cast<int64_t>(plan_.items.size()) > max_items_) {
    return absl::InternalError(absl::StrCat("plan has ", plan_.items.size(), " work items; workspace holds ", max_items_));
  }

  // ---- Appends, in task order; a later write to the same slot wins, so only
  // the last write of each (layer, slot) is kept (one launch, no races).
  append_rows_.clear();
  append_slots_.clear();
  if (total_append > 0) {
    last_append_.clear();
    last_append_.reserve(total_append);
    for (int32_t ti = 0; ti < static_cast<int32_t>(tasks.size()); ++ti) {
      const PrefillTask& t = tasks[ti];
      for (int64_t r = 0; r < t.num_append; ++r) {
        const int64_t kv_slot = int64_t{t.layer} * g.SlotsPerLayer() + t.append_slots[r];
        auto [pos, inserted] = last_append_.try_emplace(kv_slot, static_cast<int64_t>(append_rows_.size()));
        if (inserted) {
          append_rows_.push_back({ti, r});
          append_slots_.push_back(kv_slot);
        } else {
          append_rows_[pos->second] = {ti, r};
        }
      }
    }
  }
  const int64_t n_append = static_cast<int64_t>(append_slots_.size());

  // ---- Pack inputs into the slot's pinned staging.
  Packer in(slot.h_in, in_capacity_);
  const int64_t off_q = in.Take(total_q * H * D * 2);
  const int64_t off_idx = in.Take(total_idx * 4);
  const int64_t off_seqs = in.Take(static_cast<int64_t>(seqs_.size() * sizeof(PrefillSeq)));
  const int64_t off_items = in.Take(static_cast<int64_t>(plan_.items.size() * sizeof(PrefillWorkItem)));
  const int64_t off_merges = in.Take(static_cast<int64_t>(plan_.merges.size() * sizeof(SplitMergeSeq)));
  const int64_t off_slots = in.Take(n_append * 8);
  const int64_t off_k = in.Take(n_append * row_elems * 2);
  const int64_t off_v = in.Take(n_append * row_elems * 2);
  if (off_q < 0 || off_idx < 0 || off_seqs < 0 || off_items < 0 || off_merges < 0 || off_slots < 0 ||
      off_k < 0 || off_v < 0) {
    return absl::InternalError("input staging overflow");
  }
  {
    int64_t row = 0, idx = 0;
    for (const PrefillTask& t : tasks) {
      if (t.total_q > 0) std::memcpy(in.At(off_q) + row * H * D * 2, t.q, size_t(t.total_q) * H * D * 2);
      if (t.num_kv_indices > 0) {
        std::memcpy(in.At(off_idx) + idx * 4, t.kv_indices, size_t(t.num_kv_indices) * 4);
      }
      row += t.total_q;
      idx += t.num_kv_indices;
    }
    if (!seqs_.empty()) std::memcpy(in.At(off_seqs), seqs_.data(), seqs_.size() * sizeof(PrefillSeq));
    if (!plan_.items.empty()) {
      std::memcpy(in.At(off_items), plan_.items.data(), plan_.items.size() * sizeof(PrefillWorkItem));
    }
    if (!plan_.merges.empty()) {
      std::memcpy(in.At(off_merges), plan_.merges.data(), plan_.merges.size() * sizeof(SplitMergeSeq));
    }
    if (n_append > 0) {
      std::memcpy(in.At(off_slots), append_slots_.data(), n_append * 8);
      const size_t rb = size_t(row_elems) * 2;
      for (int64_t i = 0; i < n_append; ++i) {
        const PrefillTask& t = tasks[append_rows_[i].first];
        const int64_t r = append_rows_[i].second;
        std::memcpy(in.At(off_k) + i * rb, static_cast<const uint8_t*>(t.append_k) + r * rb, rb);
        std::memcpy(in.At(off_v) + i * rb, static_cast<const uint8_t*>(t.append_v) + r * rb, rb);
      }
    }
  }
  const int64_t off_o = 0;
  const int64_t off_lse = AlignUp(total_q * H * D * 2);
  const int64_t out_bytes = off_lse + total_q * H * 4;
  uint8_t* const d_in = slot.d_in;
  cudaEvent_t* const ev = slot.events;
  const bool attend = !plan_.items.empty();
  const bool merge = !plan_.merges.empty();

  // ---- Upload (copy-in stream); appends, one attention launch, a merge if
  // anything was split (compute stream); one download (copy-out stream).
  // A failure after the upload was queued leaves work on the streams that reads
  // this slot: wait for it (the device is probably lost; the scheduler's fault
  // handler marks the server unhealthy) so the slot is never reused under it.
  const absl::Status launched = [&]() -> absl::Status {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_in, slot.h_in, in.used(), cudaMemcpyHostToDevice, copy_in_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[kUploaded], copy_in_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, ev[kUploaded], 0));
    if (n_append > 0) {
      AppendKvParams ap;
      ap.k_cache = k_pool_;
      ap.v_cache = v_pool_;
      ap.k = d_in + off_k;
      ap.v = d_in + off_v;
      ap.slots = reinterpret_cast<const int64_t*>(d_in + off_slots);
      ap.n = n_append;
      ap.layer = 0;  // slots are layer-global
      ap.geo = g;
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[kAppendBegin], compute_));
      ATTNSERVE_CUDA_RETURN_IF_ERROR(AppendKvCuda(ap, compute_));
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[kAppendEnd], compute_));
    }
    PagedPrefillParams pp;
    pp.q = d_in + off_q;
    pp.o = slot.d_out + off_o;
    pp.lse = reinterpret_cast<float*>(slot.d_out + off_lse);
    pp.k_cache = k_pool_;
    pp.v_cache = v_pool_;
    pp.kv_indices = reinterpret_cast<const int32_t*>(d_in + off_idx);
    pp.seqs = reinterpret_cast<const PrefillSeq*>(d_in + off_seqs);
    pp.num_seqs = static_cast<int32_t>(seqs_.size());
    pp.total_q = static_cast<int32_t>(total_q);
    pp.geo = g;
    if (attend) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[kAttnBegin], compute_));
      ATTNSERVE_CUDA_RETURN_IF_ERROR(PagedPrefillCuda(
          pp, reinterpret_cast<const PrefillWorkItem*>(d_in + off_items), static_cast<int32_t>(plan_.items.size()),
          d_part_o_, d_part_lse_, variant, compute_));
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[kAttnEnd], compute_));
    }
    if (merge) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[kMergeBegin], compute_));
      ATTNSERVE_CUDA_RETURN_IF_ERROR(MergeSplitsCuda(pp, reinterpret_cast<const SplitMergeSeq*>(d_in + off_merges),
                                                     static_cast<int32_t>(plan_.merges.size()), plan_.merge_pairs,
                                                     d_part_o_, d_part_lse_, compute_));
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[kMergeEnd], compute_));
    }
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[kComputed], compute_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_out_, ev[kComputed], 0));
    // Outputs in pinned response buffers are copied straight into them; the
    // rest go through the slot's staging and Complete unpacks them.
    bool staged = false;
    int64_t row = 0;
    for (const PrefillTask& t : tasks) {
      if (t.total_q > 0 && t.out_pinned) {
        ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(t.o, slot.d_out + off_o + row * H * D * 2,
                                                       size_t(t.total_q) * H * D * 2,
                                                       cudaMemcpyDeviceToHost, copy_out_));
        ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(t.lse, slot.d_out + off_lse + row * H * 4,
                                                       size_t(t.total_q) * H * 4,
                                                       cudaMemcpyDeviceToHost, copy_out_));
      } else if (t.total_q > 0) {
        staged = true;
      }
      row += t.total_q;
    }
    if (staged) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(slot.h_out, slot.d_out, out_bytes, cudaMemcpyDeviceToHost, copy_out_));
    }
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[kDownloaded], copy_out_));
    return absl::OkStatus();
  }();
  if (!launched.ok()) {
    for (cudaStream_t st : {copy_in_, compute_, copy_out_}) cudaStreamSynchronize(st);
    return launched;
  }

  slot.outputs.clear();
  for (const PrefillTask& t : tasks) slot.outputs.push_back({t.o, t.lse, t.total_q, t.out_pinned});
  slot.off_lse = off_lse;
  slot.total_q = total_q;
  slot.appended = n_append > 0;
  slot.attended = attend;
  slot.merged = merge;
  {
    absl::MutexLock lock(&ring_mu_);
    ++in_flight_;
  }
  if (stats != nullptr) stats->submit_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  return absl::OkStatus();
}

absl::Status CudaBackend::Complete(BatchStats* stats) {
  int s_index;
  {
    absl::MutexLock lock(&ring_mu_);
    if (in_flight_ == 0) return absl::FailedPreconditionError("no batch was submitted");
    s_index = head_;
  }
  Slot& slot = slots_[s_index];
  // The slot leaves the ring however this ends, so that the pipeline never
  // wedges on a failed batch.
  auto release = [this] {
    absl::MutexLock lock(&ring_mu_);
    head_ = (head_ + 1) % kSlots;
    --in_flight_;
  };
  const absl::Time start = absl::Now();
  cudaError_t err = cudaSetDevice(options_.device);
  if (err == cudaSuccess) err = cudaEventSynchronize(slot.events[kDownloaded]);
  if (err != cudaSuccess) {
    release();
    return absl::InternalError(absl::StrCat("waiting for a batch: ", cudaGetErrorName(err), " (",
                                            cudaGetErrorString(err), ")"));
  }
  const absl::Time downloaded = absl::Now();

  // ---- Outputs back to each task.
  const int64_t H = geo_.num_qo_heads, D = geo_.head_dim;
  int64_t row = 0;
  for (const Slot::Output& out : slot.outputs) {
    if (out.rows > 0 && !out.pinned) {
      std::memcpy(out.o, slot.h_out + row * H * D * 2, size_t(out.rows) * H * D * 2);
      std::memcpy(out.lse, slot.h_out + slot.off_lse + row * H * 4, size_t(out.rows) * H * 4);
    }
    row += out.rows;
  }
  const absl::Time unpacked = absl::Now();
  // Kernel times, read while the slot (and its events) is still ours.
  BatchStats t;
  float ms = 0;
  auto elapsed = [&](int begin, int end) {
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, slot.events[begin], slot.events[end]);
    return err == cudaSuccess ? ms * 1e-3 : 0.0;
  };
  if (slot.appended) {
    t.append_launches = 1;
    t.append_seconds = elapsed(kAppendBegin, kAppendEnd);
  }
  if (slot.attended) {
    t.attention_launches = 1;
    t.attention_seconds = elapsed(kAttnBegin, kAttnEnd);
  }
  if (slot.merged) {
    t.merge_launches = 1;
    t.merge_seconds = elapsed(kMergeBegin, kMergeEnd);
  }
  release();
  if (stats != nullptr) {
    stats->append_launches += t.append_launches;
    stats->append_seconds += t.append_seconds;
    stats->attention_launches += t.attention_launches;
    stats->attention_seconds += t.attention_seconds;
    stats->merge_launches += t.merge_launches;
    stats->merge_seconds += t.merge_seconds;
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
  const int64_t rb = geo_.RowElems() * 2;
  Slot& slot = slots_[0];
  Packer in(slot.h_in, in_capacity_);
  const int64_t off_slots = in.Take(n * 8);
  const int64_t off_k = in.Take(n * rb);
  const int64_t off_v = in.Take(n * rb);
  if (off_slots < 0 || off_k < 0 || off_v < 0) return absl::InternalError("KV staging overflow");
  std::memcpy(in.At(off_slots), rows.slots + begin, n * 8);
  if (scatter) {
    std::memcpy(in.At(off_k), static_cast<const uint8_t*>(rows.k) + begin * rb, n * rb);
    std::memcpy(in.At(off_v), static_cast<const uint8_t*>(rows.v) + begin * rb, n * rb);
  }
  const int64_t upload = scatter ? in.used() : n * 8;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.d_in, slot.h_in, upload, cudaMemcpyHostToDevice, compute_));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.events[kAppendBegin], compute_));
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
    ATTNSERVE_CUDA_RETURN_IF_ERROR(GatherKvCuda(gp, compute_));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.events[kAppendEnd], compute_));
  if (!scatter) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(slot.h_in + off_k, slot.d_in + off_k, off_v + n * rb - off_k, cudaMemcpyDeviceToHost, compute_));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  if (!scatter) {
    std::memcpy(static_cast<uint8_t*>(rows.k) + begin * rb, in.At(off_k), n * rb);
    std::memcpy(static_cast<uint8_t*>(rows.v) + begin * rb, in.At(off_v), n * rb);
  }
  float ms = 0;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, slot.events[kAppendBegin], slot.events[kAppendEnd]));
  *seconds += ms * 1e-3f;
  return absl::OkStatus();
}

absl::Status CudaBackend::WriteKv(const KvRows& rows, BatchStats* stats) {
  if (absl::Status st = CheckIdle(); !st.ok()) return st;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  float seconds = 0;
  int32_t launches = 0;
  for (int64_t begin = 0; begin < rows.n; begin += max_append_) {
    const int64_t n = std::min(max_append_, rows.n - begin);
    absl::Status st = CopyRowsChunk(rows, begin, n, /*scatter=*/true, &seconds);
    if (!st.ok()) return st;
    ++launches;
  }
  if (stats != nullptr) {
    stats->append_launches += launches;
    stats->append_seconds += seconds;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::ReadKv(const KvRows& rows) {
  if (absl::Status st = CheckIdle(); !st.ok()) return st;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  float seconds = 0;
  for (int64_t begin = 0; begin < rows.n; begin += max_append_) {
    const int64_t n = std::min(max_append_, rows.n - begin);
    absl::Status st = CopyRowsChunk(rows, begin, n, /*scatter=*/false, &seconds);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) {
  if (absl::Status st = CheckIdle(); !st.ok()) return st;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  Slot& slot = slots_[0];
  const int64_t per_launch = in_capacity_ / 4;
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
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.events[kAppendBegin], compute_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(ZeroPagesCuda(zp, compute_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.events[kAppendEnd], compute_));
    // The next chunk reuses the staging: wait for this one.
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
    float ms = 0;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(&ms, slot.events[kAppendBegin], slot.events[kAppendEnd]));
    seconds += ms / 1e3f;
    ++launches;
  }
  if (stats != nullptr) {
    stats->append_launches += launches;
    stats->append_seconds += seconds;
  }
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
