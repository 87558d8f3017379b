// CudaBackend: paged KV pools in device memory and the batched attention path.
// Everything is allocated in Create(); RunBatch / WriteKv / ReadKv only pack
// into pinned staging, copy, launch and copy back.
#include "server/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    const void* device_ptrs[] = {k_pool_, v_pool_, d_in_, d_out_, d_part_o_, d_part_lse_};
    for (const void* p : device_ptrs) cudaFree(const_cast<void*>(p));
    cudaFreeHost(h_in_);
    cudaFreeHost(h_out_);
  }

  absl::Status Init();

  std::string Name() const override { return "cuda"; }
  std::string Device() const override { return device_name_; }
  const KvGeometry& Geometry() const override { return geo_; }

  absl::Status RunBatch(absl::Span<const PrefillTask> tasks, BatchStats* stats) override;
  absl::Status WriteKv(const KvRows& rows, BatchStats* stats) override;
  absl::Status ReadKv(const KvRows& rows) override;
  // MergeStates stays on the CPU default: its inputs and outputs live in host
  // memory, so a GPU pass would move every byte over PCIe (tens of GB/s, after
  // a copy into pinned staging) where the CPU reads it once at memory speed.

 private:
  absl::Status Alloc(void** p, int64_t bytes, const char* what);
  absl::Status AllocHost(void** p, int64_t bytes, const char* what);
  // Packs slots / k / v of rows [begin, begin + n) of `rows` for WriteKv.
  absl::Status CopyRowsChunk(const KvRows& rows, int64_t begin, int64_t n, bool scatter,
                             float* seconds);

  BackendOptions options_;
  KvGeometry geo_;
  std::string device_name_;
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

  void* k_pool_ = nullptr;
  void* v_pool_ = nullptr;
  // Inputs: pinned host staging and its device mirror (same layout).
  uint8_t* h_in_ = nullptr;
  uint8_t* d_in_ = nullptr;
  int64_t in_capacity_ = 0;
  // Outputs: o then lse.
  uint8_t* h_out_ = nullptr;
  uint8_t* d_out_ = nullptr;
  int64_t out_capacity_ = 0;
  float* d_part_o_ = nullptr;
  float* d_part_lse_ = nullptr;

  cudaStream_t stream_ = nullptr;
  // append begin/end, attention begin/end, merge begin/end.
  cudaEvent_t events_[6] = {};

  PrefillPlan plan_;  // reused between batches
  std::vector<PrefillSeq> seqs_;
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
  if (g.head_dim != 64 && g.head_dim != 128 && g.head_dim != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim ", g.head_dim, " not supported by the CUDA backend (64, 128 or 256)"));
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
  if (!(st = Alloc(reinterpret_cast<void**>(&d_in_), in_capacity_, "input staging")).ok()) return st;
  if (!(st = Alloc(reinterpret_cast<void**>(&d_out_), out_capacity_, "output staging")).ok()) return st;
  if (!(st = Alloc(reinterpret_cast<void**>(&d_part_o_), max_partial_pairs_ * D * 4, "split partials")).ok()) {
    return st;
  }
  if (!(st = Alloc(reinterpret_cast<void**>(&d_part_lse_), max_partial_pairs_ * 4, "split LSEs")).ok()) {
    return st;
  }
  if (!(st = AllocHost(reinterpret_cast<void**>(&h_in_), in_capacity_, "input staging")).ok()) return st;
  if (!(st = AllocHost(reinterpret_cast<void**>(&h_out_), out_capacity_, "output staging")).ok()) return st;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (cudaEvent_t& e : events_) ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  plan_.items.reserve(1024);
  return absl::OkStatus();
}

absl::Status CudaBackend::RunBatch(absl::Span<const PrefillTask> tasks, BatchStats* stats) {
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
  std::vector<std::pair<int32_t, int64_t>> append_rows;  // (task, row)
  std::vector<int64_t> append_slots;
  if (total_append > 0) {
    std::unordered_map<int64_t, int64_t> last;
    last.reserve(total_append * 2);
    for (int32_t ti = 0; ti < static_cast<int32_t>(tasks.size()); ++ti) {
      const PrefillTask& t = tasks[ti];
      for (int64_t r = 0; r < t.num_append; ++r) {
        const int64_t slot = int64_t{t.layer} * g.SlotsPerLayer() + t.append_slots[r];
        auto [pos, inserted] = last.try_emplace(slot, static_cast<int64_t>(append_rows.size()));
        if (inserted) {
          append_rows.push_back({ti, r});
          append_slots.push_back(slot);
        } else {
          append_rows[pos->second] = {ti, r};
        }
      }
    }
  }
  const int64_t n_append = static_cast<int64_t>(append_slots.size());

  // ---- Pack inputs into pinned staging.
  Packer in(h_in_, in_capacity_);
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
      std::memcpy(in.At(off_slots), append_slots.data(), n_append * 8);
      const size_t rb = size_t(row_elems) * 2;
      for (int64_t i = 0; i < n_append; ++i) {
        const PrefillTask& t = tasks[append_rows[i].first];
        const int64_t r = append_rows[i].second;
        std::memcpy(in.At(off_k) + i * rb, static_cast<const uint8_t*>(t.append_k) + r * rb, rb);
        std::memcpy(in.At(off_v) + i * rb, static_cast<const uint8_t*>(t.append_v) + r * rb, rb);
      }
    }
  }
  const int64_t off_o = 0;
  const int64_t off_lse = AlignUp(total_q * H * D * 2);
  const int64_t out_bytes = off_lse + total_q * H * 4;

  // ---- One upload, appends, one attention launch, merge if split, one download.
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_in_, h_in_, in.used(), cudaMemcpyHostToDevice, stream_));
  if (n_append > 0) {
    AppendKvParams ap;
    ap.k_cache = k_pool_;
    ap.v_cache = v_pool_;
    ap.k = d_in_ + off_k;
    ap.v = d_in_ + off_v;
    ap.slots = reinterpret_cast<const int64_t*>(d_in_ + off_slots);
    ap.n = n_append;
    ap.layer = 0;  // slots are layer-global
    ap.geo = g;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[0], stream_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(AppendKvCuda(ap, stream_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[1], stream_));
  }
  PagedPrefillParams pp;
  pp.q = d_in_ + off_q;
  pp.o = d_out_ + off_o;
  pp.lse = reinterpret_cast<float*>(d_out_ + off_lse);
  pp.k_cache = k_pool_;
  pp.v_cache = v_pool_;
  pp.kv_indices = reinterpret_cast<const int32_t*>(d_in_ + off_idx);
  pp.seqs = reinterpret_cast<const PrefillSeq*>(d_in_ + off_seqs);
  pp.num_seqs = static_cast<int32_t>(seqs_.size());
  pp.total_q = static_cast<int32_t>(total_q);
  pp.geo = g;
  const bool attend = !plan_.items.empty();
  const bool merge = !plan_.merges.empty();
  if (attend) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[2], stream_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(PagedPrefillCuda(
        pp, reinterpret_cast<const PrefillWorkItem*>(d_in_ + off_items), static_cast<int32_t>(plan_.items.size()),
        d_part_o_, d_part_lse_, variant, stream_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[3], stream_));
  }
  if (merge) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[4], stream_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(MergeSplitsCuda(pp, reinterpret_cast<const SplitMergeSeq*>(d_in_ + off_merges),
                                                   static_cast<int32_t>(plan_.merges.size()), plan_.merge_pairs,
                                                   d_part_o_, d_part_lse_, stream_));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[5], stream_));
  }
  if (total_q > 0) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(h_out_, d_out_, out_bytes, cudaMemcpyDeviceToHost, stream_));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));

  // ---- Outputs back to each task.
  {
    int64_t row = 0;
    for (const PrefillTask& t : tasks) {
      if (t.total_q > 0) {
        std::memcpy(t.o, h_out_ + off_o + row * H * D * 2, size_t(t.total_q) * H * D * 2);
        std::memcpy(t.lse, h_out_ + off_lse + row * H * 4, size_t(t.total_q) * H * 4);
      }
      row += t.total_q;
    }
  }
  if (stats != nullptr) {
    float ms = 0;
    if (n_append > 0) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[0], events_[1]));
      stats->append_launches += 1;
      stats->append_seconds += ms * 1e-3;
    }
    if (attend) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[2], events_[3]));
      stats->attention_launches += 1;
      stats->attention_seconds += ms * 1e-3;
    }
    if (merge) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[4], events_[5]));
      stats->merge_launches += 1;
      stats->merge_seconds += ms * 1e-3;
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::CopyRowsChunk(const KvRows& rows, int64_t begin, int64_t n, bool scatter,
                                        float* seconds) {
  const int64_t rb = geo_.RowElems() * 2;
  Packer in(h_in_, in_capacity_);
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
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(d_in_, h_in_, upload, cudaMemcpyHostToDevice, stream_));
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[0], stream_));
  if (scatter) {
    AppendKvParams ap;
    ap.k_cache = k_pool_;
    ap.v_cache = v_pool_;
    ap.k = d_in_ + off_k;
    ap.v = d_in_ + off_v;
    ap.slots = reinterpret_cast<const int64_t*>(d_in_ + off_slots);
    ap.n = n;
    ap.layer = rows.layer;
    ap.geo = geo_;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(AppendKvCuda(ap, stream_));
  } else {
    GatherKvParams gp;
    gp.k_cache = k_pool_;
    gp.v_cache = v_pool_;
    gp.k = d_in_ + off_k;
    gp.v = d_in_ + off_v;
    gp.slots = reinterpret_cast<const int64_t*>(d_in_ + off_slots);
    gp.n = n;
    gp.layer = rows.layer;
    gp.geo = geo_;
    ATTNSERVE_CUDA_RETURN_IF_ERROR(GatherKvCuda(gp, stream_));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(events_[1], stream_));
  if (!scatter) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(h_in_ + off_k, d_in_ + off_k, off_v + n * rb - off_k, cudaMemcpyDeviceToHost, stream_));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (!scatter) {
    std::memcpy(static_cast<uint8_t*>(rows.k) + begin * rb, in.At(off_k), n * rb);
    std::memcpy(static_cast<uint8_t*>(rows.v) + begin * rb, in.At(off_v), n * rb);
  }
  float ms = 0;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, events_[0], events_[1]));
  *seconds += ms * 1e-3f;
  return absl::OkStatus();
}

absl::Status CudaBackend::WriteKv(const KvRows& rows, BatchStats* stats) {
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
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  float seconds = 0;
  for (int64_t begin = 0; begin < rows.n; begin += max_append_) {
    const int64_t n = std::min(max_append_, rows.n - begin);
    absl::Status st = CopyRowsChunk(rows, begin, n, /*scatter=*/false, &seconds);
    if (!st.ok()) return st;
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
