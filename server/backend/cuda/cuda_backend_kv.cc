// CudaBackend's work on an idle backend (cuda_backend_impl.h): KV rows
// written and read through the idle slot's staging (CopyRows), pages zeroed
// on the device, FP8 scales set, and MergeStates on the GPU or through the
// host. Each call synchronizes before it returns.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/append_kv.h"
#include "kernels/kv/kv_rows_cuda.h"
#include "kernels/merge/merge_cuda.h"
#include "kernels/merge_states.h"
#include "server/backend/cuda/cuda_backend_impl.h"
#include "server/backend/cuda/cuda_util.h"
#include "server/backend/cuda/staging_packer.h"
#include "server/core/status_macros.h"

namespace attnserve {
namespace cuda_backend_internal {
namespace {

// States one MergeStatesCuda launch takes (kernels/merge/merge_cuda.h).
constexpr int32_t kMaxMergeStatesPerLaunch = 16;

}  // namespace

absl::Status CudaBackend::CheckIdle() {
  if (const int n = ring_->InFlight(); n != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(n, " batch(es) in flight: KV reads and writes need an idle backend"));
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
  const bool has_v = geo_.HasVPool();  // MLA: K's rows alone (rows.v is null)
  const int64_t off_slots = in.Take(n * 8);
  const int64_t off_k = in.Take(n * rb);
  const int64_t off_v = in.Take(has_v ? n * rb : 0);
  if (off_slots < 0 || off_k < 0 || off_v < 0) return absl::InternalError("KV staging overflow");
  // A failure part-way returns before the synchronize below: what was queued
  // already (copies into device regions the caller may release next) is
  // waited for first.
  struct SyncOnReturn {
    cudaStream_t stream;
    bool armed = true;
    ~SyncOnReturn() {
      if (armed) cudaStreamSynchronize(stream);
    }
  } sync_on_error{compute_};
  std::memcpy(in.At(off_slots), rows.slots + begin, n * 8);
  // k and v: host rows through the pinned staging (one upload with the
  // slots when both are host), device rows (CUDA regions) device to device.
  // A WriteKV's inline rows that arrived in pieces are gathered into the
  // staging (their one host copy; the pointer is null then).
  // K's rows, then V's (none without a V pool: MLA).
  struct Stream {
    int64_t off;  // in the staging
    uint8_t* at;  // the request's rows [begin, begin + n)
    bool on_device;
    const ScatterList* scattered;
  };
  const Stream streams[2] = {
      {off_k, rows.k == nullptr ? nullptr : static_cast<uint8_t*>(rows.k) + begin * rb, rows.k_on_device,
       &rows.k_scattered},
      {off_v, rows.v == nullptr ? nullptr : static_cast<uint8_t*>(rows.v) + begin * rb, rows.v_on_device,
       &rows.v_scattered}};
  const auto used = absl::MakeConstSpan(streams, has_v ? 2 : 1);
  bool any_device = false;
  for (const Stream& st : used) any_device |= st.on_device;
  if (scatter) {
    for (const Stream& st : used) {
      if (st.on_device) continue;
      if (!st.scattered->empty()) {
        CopyOut(*st.scattered, begin * rb, n * rb, in.At(st.off));
      } else {
        CopyBytes(in.At(st.off), st.at, n * rb);
      }
    }
  }
  const int64_t upload = scatter && !any_device ? in.used() : n * 8;
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.d_in, slot.h_in, upload, cudaMemcpyHostToDevice, compute_));
  if (scatter && any_device) {
    for (const Stream& st : used) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.d_in + st.off, st.on_device ? st.at : in.At(st.off),
                                                     n * rb,
                                                     st.on_device ? cudaMemcpyDefault : cudaMemcpyHostToDevice,
                                                     compute_));
    }
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.events[StagingRing::kAppendBegin], compute_));
  if (scatter) {
    AppendKvParams ap;
    ap.k_cache = k_pool_;
    ap.v_cache = v_pool_;
    ap.k = slot.d_in + off_k;
    ap.v = has_v ? slot.d_in + off_v : nullptr;
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
    gp.v = has_v ? slot.d_in + off_v : nullptr;
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
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.h_in + off_k, slot.d_in + off_k,
                                                   off_v + (has_v ? n * rb : 0) - off_k,
                                                   cudaMemcpyDeviceToHost, compute_));
  } else if (!scatter) {
    for (const Stream& st : used) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(st.on_device ? st.at : in.At(st.off), slot.d_in + st.off,
                                                     n * rb,
                                                     st.on_device ? cudaMemcpyDefault : cudaMemcpyDeviceToHost,
                                                     compute_));
    }
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(compute_));
  sync_on_error.armed = false;
  if (!scatter) {
    for (const Stream& st : used) {
      if (!st.on_device) CopyBytes(st.at, in.At(st.off), n * rb);
    }
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

}  // namespace cuda_backend_internal
}  // namespace attnserve
