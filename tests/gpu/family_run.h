// Running a HostBatch (gpu_test_util.h) through one kernel family the way the
// server does (its plan, the kernel, the split merge) and comparing the result
// with the float64 reference: the one runner of the kernel tests
// (kernels_gpu_test.cc, decode_kernel_test.cc, variants_gpu_test.cc). Every
// CUDA call is checked; outputs, LSEs and the split workspace are poisoned
// with 0xFF bytes (NaN) before each run, and a repeated run must give the
// same bits.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/decode/decode_cuda.h"
#include "kernels/merge/merge_cuda.h"
#include "kernels/plan/decode_plan.h"
#include "kernels/prefill_cuda.h"
#include "tests/gpu/gpu_test_util.h"

namespace attnserve {
namespace gpu_test {

// Device buffer whose every call is checked: errors land in *err (first one
// wins) so that a test reports the failing call instead of crashing.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  std::string* err;
  DeviceBuffer(size_t count, std::string* e) : n(count), err(e) {
    Check(cudaMalloc(&ptr, std::max<size_t>(count, 1) * sizeof(T)), "cudaMalloc");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
  void Check(cudaError_t e, const char* what) {
    if (e != cudaSuccess && err->empty()) *err = std::string(what) + ": " + cudaGetErrorString(e);
  }
  void Upload(const std::vector<T>& v) {
    if (!v.empty()) Check(cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> Download() {
    std::vector<T> v(n);
    if (n > 0) Check(cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return v;
  }
  void Poison() { Check(cudaMemset(ptr, 0xFF, std::max<size_t>(n, 1) * sizeof(T)), "poison"); }
  void Zero() { Check(cudaMemset(ptr, 0, std::max<size_t>(n, 1) * sizeof(T)), "zero"); }
};

inline int NumSms() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

struct RunResult {
  std::string error;  // empty: every run matched the reference
  bool split = false;
  int cluster = 0;  // decode: the plan's cluster
  // RunPrefill: the outputs of its first run (16-bit bits) and LSEs.
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

// The batch on the device: pools, Q, page table, sequences, sink sets, and
// the outputs; Params() the kernels' view of it.
struct DeviceBatch {
  DeviceBuffer<uint16_t> k, v, q, o;
  DeviceBuffer<uint8_t> k8, v8;  // FP8 batches' pools
  DeviceBuffer<float> k_scales, v_scales;
  DeviceBuffer<float> lse, sinks;
  DeviceBuffer<int32_t> idx;
  DeviceBuffer<PrefillSeq> seqs;
  const HostBatch& b;
  DeviceBatch(const HostBatch& hb, std::string* err)
      : k(hb.k_pool.size(), err), v(hb.v_pool.size(), err), q(hb.q.size(), err), o(hb.q.size(), err),
        k8(hb.k8.size(), err), v8(hb.v8.size(), err), k_scales(hb.k_scales.size(), err),
        v_scales(hb.v_scales.size(), err),
        lse(size_t(hb.total_q) * hb.geo.num_qo_heads, err), sinks(hb.sinks.size(), err),
        idx(hb.kv_indices.size(), err), seqs(hb.seqs.size(), err), b(hb) {
    k.Upload(hb.k_pool);
    v.Upload(hb.v_pool);
    k8.Upload(hb.k8);
    v8.Upload(hb.v8);
    k_scales.Upload(hb.k_scales);
    v_scales.Upload(hb.v_scales);
    q.Upload(hb.q);
    idx.Upload(hb.kv_indices);
    seqs.Upload(hb.seqs);
    sinks.Upload(hb.sinks);
  }
  PagedPrefillParams Params() const {
    PagedPrefillParams p;
    p.q = q.ptr;
    p.o = o.ptr;
    p.lse = lse.ptr;
    const bool fp8 = b.geo.KvIsFp8();
    p.k_cache = fp8 ? static_cast<const void*>(k8.ptr) : k.ptr;
    p.v_cache = fp8 ? static_cast<const void*>(v8.ptr) : v.ptr;
    p.k_scales = fp8 ? k_scales.ptr : nullptr;
    p.v_scales = fp8 ? v_scales.ptr : nullptr;
    p.kv_indices = idx.ptr;
    p.seqs = seqs.ptr;
    p.sinks = b.sinks.empty() ? nullptr : sinks.ptr;
    p.any_soft_cap = AnySoftCap(b.seqs.data(), static_cast<int32_t>(b.seqs.size()));
    p.num_seqs = static_cast<int32_t>(b.seqs.size());
    p.total_q = b.total_q;
    p.geo = b.geo;
    return p;
  }
  // Compares the outputs with the reference (each LSE within 1e-3, or with
  // per_row_bounds within the reference's bound of its row); "" when they
  // match. Keeps them for SameAsLast.
  std::string Check(const ReferenceResult& ref, bool per_row_bounds = false) {
    last_o = o.Download();
    last_lse = lse.Download();
    if (!o.err->empty()) return *o.err;
    return Compare(b.geo.dtype, last_o, last_lse, ref.o, ref.lse, 1e-3, per_row_bounds ? &ref.lse_bound : nullptr);
  }
  // Whether the outputs equal, bit for bit, those of the last Check (the
  // same plan on the same inputs gives the same bits: docs/design.md
  // section 3, "Deterministic answers"); "" when they do.
  std::string SameAsLast() {
    const std::vector<uint16_t> got_o = o.Download();
    const std::vector<float> got_lse = lse.Download();
    if (!o.err->empty()) return *o.err;
    for (size_t i = 0; i < got_o.size(); ++i) {
      if (got_o[i] != last_o[i]) return "not deterministic: output element " + std::to_string(i) + " differs";
    }
    for (size_t i = 0; i < got_lse.size(); ++i) {
      if (std::memcmp(&got_lse[i], &last_lse[i], sizeof(float)) != 0) {
        return "not deterministic: LSE " + std::to_string(i) + " differs";
      }
    }
    return "";
  }
  std::vector<uint16_t> last_o;
  std::vector<float> last_lse;
};

// The prefill family's options: force_split plans as for a huge GPU (every
// chunk of min_chunk keys its own item); max_ctas: the persistent kernels'
// grid (0: one wave); plan_ctas: the CTAs the plan deals the items to (-1:
// the grid), to run a plan dealt for another grid, which must still compute
// every item.
struct PrefillRun {
  bool force_split = false;
  int min_chunk = 512;
  int32_t max_ctas = 0;
  int32_t plan_ctas = -1;
  bool drop_scales = false;  // FP8 batches: the kernel gets no scales (1.0), as RunDecode's
  // > 0: the reference computes sequences of at least this many query rows
  // on their rows rounded as the FP8-query kernel rounds them, and holds
  // each LSE to its row's bound (CachedReference's fp8_query_min_rows).
  int fp8_query_min_rows = 0;
  // PagedPrefillParams::mean_kv_per_row (0: tensor copies wherever the pages
  // allow; the batch's own mean: as the server runs it).
  int64_t mean_kv_per_row = 0;
};

// Plan + prefill kernel (+ split merge), once, against the reference.
inline RunResult RunPrefill(const HostBatch& b, PrefillKernel kernel, const PrefillRun& run = {}) {
  RunResult res;
  std::string& err = res.error;
  const KvGeometry& g = b.geo;
  PrefillPlanOptions opt;
  opt.num_sms = run.force_split ? 1 << 20 : NumSms();
  opt.ctas_per_sm = PrefillCtasPerSm(kernel, g.head_dim, g.dtype, g.kv_fp8);
  opt.min_chunk = run.min_chunk;
  opt.tile_rows = PrefillTileRows(kernel, g.head_dim);
  opt.max_partial_pairs = int64_t{1} << 24;
  const int32_t ctas =
      run.plan_ctas >= 0 ? run.plan_ctas : run.max_ctas > 0 ? run.max_ctas : NumSms() * opt.ctas_per_sm;
  opt.persistent_ctas = PrefillPersistentCtas(kernel, ctas, 1);
  PrefillPlan plan;
  BuildPrefillPlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, opt, &plan);
  res.split = !plan.merges.empty();

  DeviceBatch d(b, &err);
  DeviceBuffer<PrefillWorkItem> items(plan.items.size(), &err);
  DeviceBuffer<SplitMergeSeq> merges(plan.merges.size(), &err);
  DeviceBuffer<float> part_o(size_t(plan.partial_pairs) * g.head_dim, &err);
  DeviceBuffer<float> part_lse(plan.partial_pairs, &err);
  items.Upload(plan.items);
  merges.Upload(plan.merges);
  d.o.Poison();
  d.lse.Poison();
  part_o.Poison();
  part_lse.Poison();
  if (!err.empty()) return res;
  PagedPrefillParams p = d.Params();
  p.max_ctas = run.max_ctas;
  p.mean_kv_per_row = run.mean_kv_per_row;
  if (run.drop_scales) p.k_scales = p.v_scales = nullptr;
  // Twice: against the reference, then the same bits again.
  for (int again = 0; again < 2; ++again) {
    if (again == 1) {
      d.o.Poison();
      d.lse.Poison();
      part_o.Poison();
      part_lse.Poison();
    }
    cudaError_t e = PagedPrefillCuda(p, items.ptr, static_cast<int32_t>(plan.items.size()), part_o.ptr,
                                     part_lse.ptr, kernel, nullptr);
    if (e == cudaSuccess && !plan.merges.empty()) {
      e = MergeSplitsCuda(p, merges.ptr, static_cast<int32_t>(plan.merges.size()), plan.merge_pairs, part_o.ptr,
                          part_lse.ptr, nullptr);
    }
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      err = std::string("CUDA: ") + cudaGetErrorString(e);
      return res;
    }
    err = again == 0 ? d.Check(*CachedReference(b, run.fp8_query_min_rows), run.fp8_query_min_rows > 0)
                     : d.SameAsLast();
    if (again == 0) {
      res.o = d.last_o;
      res.lse = d.last_lse;
    }
    if (!err.empty()) return res;
  }
  return res;
}

// The decode family: force_chunk 0 the heuristic with this GPU's SM count
// (and its cluster size, as the server plans); > 0 chunks of that many keys;
// kNoSplit never split. force_cluster > 1: cluster mode with that many CTAs
// per tile (sm_90; force_chunk ignored). Runs the batch three times on the
// same split counters, which the kernel must leave at zero.
constexpr int kNoSplit = -1;
// drop_scales (FP8 batches): the kernel gets no scales (1.0), for tests
// that show the comparison fails without them.
inline RunResult RunDecode(const HostBatch& b, int force_chunk, int force_cluster = 0,
                           bool drop_scales = false) {
  RunResult res;
  std::string& err = res.error;
  const KvGeometry& g = b.geo;
  DecodePlanOptions opt;
  opt.num_sms = NumSms();
  int max_rows = 1;
  for (const auto& s : b.seqs) max_rows = std::max(max_rows, s.q_len * (g.num_qo_heads / g.num_kv_heads));
  const int32_t tile_rows = DecodeTileRows(g.head_dim, max_rows);
  opt.ctas_per_sm = DecodeCtasPerSm(g.head_dim, g.dtype, tile_rows, g.kv_fp8);
  opt.wide_ctas_per_sm = DecodeWideCtasPerSm(g.head_dim, g.dtype, tile_rows, g.kv_fp8);
  if (force_chunk == 0 || force_cluster > 1) opt.max_cluster = DecodeMaxCluster(g.head_dim, g.dtype, tile_rows, g.kv_fp8);
  if (force_cluster > 1) {
    opt.force_cluster = force_cluster;
  } else {
    opt.force_chunk = std::max(force_chunk, 0);
    opt.no_split = force_chunk == kNoSplit;
  }
  DecodePlan plan;
  BuildDecodePlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, opt, &plan);
  res.split = plan.split_tiles > 0;
  res.cluster = plan.cluster;

  DeviceBatch d(b, &err);
  DeviceBuffer<DecodeWorkItem> items(plan.items.size(), &err);
  DeviceBuffer<float> part_o(size_t(plan.partial_slots) * plan.tile_rows * g.head_dim, &err);
  DeviceBuffer<float> part_lse(size_t(plan.partial_slots) * plan.tile_rows, &err);
  DeviceBuffer<int32_t> counters(plan.split_tiles, &err);
  items.Upload(plan.items);
  counters.Zero();
  if (!err.empty()) return res;
  PagedPrefillParams p = d.Params();
  if (drop_scales) p.k_scales = p.v_scales = nullptr;
  const auto ref = CachedReference(b);
  // Three runs on the same counters: the four-CTA FP8 kernel where one
  // exists, then the served launch twice (the second must give the same
  // bits as the first).
  for (int run = 0; run < 3; ++run) {
    d.o.Poison();
    d.lse.Poison();
    part_o.Poison();
    part_lse.Poison();
    cudaError_t e = PagedDecodeCuda(p, plan.tile_rows, items.ptr, static_cast<int32_t>(plan.items.size()),
                                    part_o.ptr, part_lse.ptr, counters.ptr, nullptr,
                                    DecodeLaunchOptions{plan.cluster, false, run == 0 ? 1 : -1});
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      err = "run " + std::to_string(run) + ": CUDA: " + cudaGetErrorString(e);
      return res;
    }
    const std::string cmp = run < 2 ? d.Check(*ref) : d.SameAsLast();
    if (!cmp.empty()) {
      err = "run " + std::to_string(run) + ": " + cmp;
      return res;
    }
    for (int32_t c : counters.Download()) {
      if (plan.split_tiles > 0 && c != 0) {
        err = "run " + std::to_string(run) + ": a split counter was left at " + std::to_string(c);
        return res;
      }
    }
  }
  return res;
}

// The batch in one line: geometry, then each sequence's (q_len/kv_len),
// mask, shift, variants, LSE base and layer.
inline std::string Describe(const HostBatch& b) {
  std::string s = "D=" + std::to_string(b.geo.head_dim) + " H=" + std::to_string(b.geo.num_qo_heads) +
                  " KVH=" + std::to_string(b.geo.num_kv_heads) + " ps=" + std::to_string(b.geo.page_size) +
                  (b.geo.dtype == KvDType::kBf16 ? " bf16" : " fp16") +
                  (b.geo.KvIsFp8() ? std::string(" kv=") + Fp8FormatName(b.geo.kv_fp8) : std::string()) +
                  " seqs:";
  for (const auto& q : b.seqs) {
    s += " (" + std::to_string(q.q_len) + "/" + std::to_string(q.kv_len) + (q.causal ? " c" : " nc") +
         (q.causal_shift != 0 ? " shift" + std::to_string(q.causal_shift) : "") +
         (q.window_left >= 0 ? " win" + std::to_string(q.window_left) : "") +
         (q.soft_cap != 0.f ? " cap" + std::to_string(q.soft_cap) : "") +
         (q.sink_index >= 0 ? " sink" + std::to_string(q.sink_index) : "") + (q.lse_base_e ? " e" : "") +
         " scale" + std::to_string(q.sm_scale) + " L" + std::to_string(q.layer) + ")";
  }
  return s;
}

}  // namespace gpu_test
}  // namespace attnserve
