// CudaBackend: paged KV pools in device memory and the batched attention path
// (docs/design.md section 2.3). Everything is allocated in Init(); Submit and
// Complete orchestrate a BatchPacker (host: flatten, route to the decode and
// prefill families, or on an MLA geometry to the MLA family; plan, dedup,
// pack), LaunchAttention (one launch per family, then the split merge) and a
// StagingRing (the pipelined slots and streams); WriteKv / ReadKv /
// ZeroPages copy through the idle slot synchronously. Regions' device side:
// cuda_region_device.cc.
//
// The compute stream runs batches in submission order, so a batch's appends
// never race another batch's attention. Split partials (both families) and
// the decode split counters are only touched on the compute stream and are
// shared by all slots.
#include "server/backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/decode/decode_cuda.h"
#include "kernels/kv/kv_rows_cuda.h"
#include "kernels/mla/mla_cuda.h"
#include "kernels/prefill_cuda.h"
#include "server/backend/cuda/attention_launch.h"
#include "server/backend/cuda/batch_packer.h"
#include "server/backend/cuda/cuda_backend_impl.h"
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

// The MLA geometries the CUDA family runs (kernels/plan/mla_plan.h,
// MlaCudaSupports).
absl::Status CheckMlaGeometry(const KvGeometry& g) {
  if (g.kv_lora_rank != kMlaKvLoraRank || g.qk_rope_head_dim != kMlaRopeDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--attention=mla with --backend=cuda needs --kv_lora_rank=", kMlaKvLoraRank, " and --qk_rope_head_dim=",
        kMlaRopeDim, " (got ", g.kv_lora_rank, " and ", g.qk_rope_head_dim,
        "); other widths run on --backend=cpu"));
  }
  if (g.KvIsFp8()) {
    return absl::InvalidArgumentError(
        "--attention=mla with --backend=cuda needs --kv_dtype=bf16 or fp16; an FP8 latent cache runs on "
        "--backend=cpu");
  }
  return absl::OkStatus();
}

}  // namespace

namespace cuda_backend_internal {

absl::Status CudaBackend::Init() {
  if (geo_.IsMla()) ATTN_RETURN_IF_ERROR(CheckMlaGeometry(geo_));
  const int count = CudaDeviceCount();
  if (count == 0) return absl::FailedPreconditionError("no CUDA device is visible");
  if (options_.device < 0 || options_.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", options_.device, " out of range: ", count, " CUDA device(s) visible"));
  }
  const KvGeometry& g = geo_;
  if (!g.IsMla() && !IsSupportedHeadDim(g.head_dim)) {
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
  if (const char* why = ""; !PrefillFamilyFitsGeometry(options_.prefill_family, g, &why)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prefill_kernel=", PrefillFamilyName(options_.prefill_family), " ", why));
  }

  // What the packer plans with: the device, each kernel's occupancy, and the
  // batch sizes the staging holds.
  PackerLimits lim;
  lim.num_sms = prop.multiProcessorCount;
  lim.device = PrefillDevice{prop.major, prop.minor};
  lim.family = options_.prefill_family;
  const int64_t group = g.num_qo_heads / g.num_kv_heads;
  lim.max_rows = std::max<int64_t>(options_.max_batch_rows, 1);
  lim.max_indices = std::max<int64_t>(options_.max_batch_kv_indices, 1);
  lim.max_append = max_append_ = std::max<int64_t>(options_.max_batch_append_rows, 1024);
  int64_t decode_slots = 1;  // the decode family's split counters
  if (g.IsMla()) {
    // Every sequence runs on the MLA family (kernels/plan/mla_plan.h's
    // bounds): its items, and its partial slots of tile_rows rows.
    lim.mla = MlaPlanOptionsForDevice();
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    lim.max_items = MlaMaxItems(lim.mla, lim.max_rows, g.num_qo_heads);
    lim.max_partial_pairs = MlaMaxPartialSlots(lim.mla) * MlaMaxTileRows(lim.mla);
  } else {
    int32_t max_ctas = 1, min_tile = INT32_MAX, max_tile = 0;
    for (int k = 0; k < kNumPrefillKernels; ++k) {
      const auto kernel = static_cast<PrefillKernel>(k);
      lim.ctas_per_sm[k] = PrefillCtasPerSm(kernel, g.head_dim, g.dtype, g.kv_fp8);
      max_ctas = std::max(max_ctas, lim.ctas_per_sm[k]);
      min_tile = std::min(min_tile, PrefillTileRows(kernel, g.head_dim));
      max_tile = std::max(max_tile, PrefillTileRows(kernel, g.head_dim));
    }
    cudaGetLastError();
    lim.max_partial_pairs = std::max<int64_t>(int64_t{4} * lim.num_sms * max_ctas * max_tile, 1 << 16);
    lim.max_items =
        g.num_kv_heads * (lim.max_rows * group / min_tile + lim.max_rows + 1) + 2 * lim.max_partial_pairs;
    // Decode family (--decode_kernel): unsplit items are at most one per
    // (KV head, 16-row tile) plus one per sequence; split ones add a partial
    // slot each.
    lim.decode = options_.decode_kernel && DecodeGeometrySupported(g);
    // sm90_fp8q rounds the queries of every sequence the prefill family
    // runs: all of them, or those the decode family leaves.
    if (options_.prefill_family == PrefillFamily::kSm90Fp8Q) {
      fp8_query_min_rows_ = lim.decode ? kMaxDecodeQueryRows + 1 : 1;
    }
    lim.decode_ctas_per_sm[0] = DecodeCtasPerSm(g.head_dim, g.dtype, 16, g.kv_fp8);
    lim.decode_ctas_per_sm[1] = DecodeCtasPerSm(g.head_dim, g.dtype, DecodeMaxTileRows(g.head_dim), g.kv_fp8);
    lim.decode_wide_ctas_per_sm[0] = DecodeWideCtasPerSm(g.head_dim, g.dtype, 16, g.kv_fp8);
    lim.decode_wide_ctas_per_sm[1] = DecodeWideCtasPerSm(g.head_dim, g.dtype, DecodeMaxTileRows(g.head_dim), g.kv_fp8);
    lim.decode_max_cluster[0] = DecodeMaxCluster(g.head_dim, g.dtype, 16, g.kv_fp8);
    lim.decode_max_cluster[1] = DecodeMaxCluster(g.head_dim, g.dtype, DecodeMaxTileRows(g.head_dim), g.kv_fp8);
    cudaGetLastError();
    decode_slots = DecodePartialSlots(lim, g.head_dim);
    lim.max_decode_items = g.num_kv_heads * (lim.max_rows * group / 16 + lim.max_rows + 1) + decode_slots;
  }
  packer_.emplace(g, lim);

  const int64_t pool_bytes = g.PoolBytes();
  ATTN_RETURN_IF_ERROR(DeviceAlloc(&k_pool_, pool_bytes, g.HasVPool() ? "the K pool" : "the latent pool",
                                   options_.device));
  if (g.HasVPool()) ATTN_RETURN_IF_ERROR(DeviceAlloc(&v_pool_, pool_bytes, "the V pool", options_.device));
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
  if (g.HasVPool()) ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemset(v_pool_, 0, pool_bytes));
  ATTN_RETURN_IF_ERROR(DeviceAlloc(reinterpret_cast<void**>(&d_part_o_),
                                   lim.max_partial_pairs * g.VDim() * 4, "split partials", options_.device));
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
  const int64_t o_row = g.ORowElems() * g.QElemBytes();
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
      ap.v = g.HasVPool() ? d_in + (fp8 ? b.off_v8 : b.off_v) : nullptr;
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
  pp.v_cache = g.HasVPool() ? v_pool_ : k_pool_;  // MLA: V is in K's rows
  pp.k_scales = d_k_scales_;
  pp.v_scales = d_v_scales_;
  pp.kv_indices = reinterpret_cast<const int32_t*>(d_in + b.off_idx);
  pp.seqs = reinterpret_cast<const PrefillSeq*>(d_in + b.off_seqs);
  pp.sinks = b.num_sink_sets > 0 ? reinterpret_cast<const float*>(d_in + b.off_sinks) : nullptr;
  pp.any_soft_cap = b.any_soft_cap;
  pp.mean_kv_per_row = b.mean_kv_per_row;
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
        ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(t.o, slot.d_out + row * o_row, size_t(t.total_q) * o_row,
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
  const int64_t o_row = geo_.ORowElems() * geo_.QElemBytes();
  const int64_t lse_row = int64_t{geo_.num_qo_heads} * 4;
  int64_t row = 0;
  for (const StagingRing::Slot::Output& out : slot->outputs) {
    if (out.rows > 0 && !out.o_direct) CopyBytes(out.o, slot->h_out + row * o_row, int64_t{out.rows} * o_row);
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

}  // namespace cuda_backend_internal

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendOptions& options) {
  auto backend = std::make_unique<cuda_backend_internal::CudaBackend>(options);
  absl::Status st = backend->Init();
  if (!st.ok()) return st;  // the destructor frees whatever was allocated
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace attnserve
