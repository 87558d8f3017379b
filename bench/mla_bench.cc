// attnserve_mla_bench: times the MLA kernel family (kernels/mla/) on the
// workloads of the MLA issue (DeepSeek V3's latent rows, 512 + 64, bf16),
// with the same-run device copy ceiling:
//   decode_h128     64 sequences x 4096 keys, 128 heads, page_size 64 (compute-bound)
//   decode_h128_ps1 the same at page_size 1
//   decode_h16      64 x 4096, 16 heads, page_size 64 (memory-bound)
//   prefill_h128    8 x 4096 causal, 128 heads, page_size 64
//   decode_h16_16x64, decode_h16_16x32_1cta: decode_h16 in the small tiles
//                   the device does not pick (A/B)
//   decode_h128_64x32, prefill_h128_64x32: the large tile in the mma.sync
//                   kernel's 64 x 32 (on sm_90 the device picks the wgmma
//                   kernel's 64 x 64; A/B)
// FLOPs count 2 x (576 + 512) x heads per visible (query, key) pair; bytes
// count each latent row read once per sequence (1152 bytes). Timing: CUDA
// events around the kernel and its merge, a 50 us spin kernel ahead of the
// start event (device time alone), warm-up, median of repeats. The PyTorch
// absorbed-MLA baseline over a dense latent cache is bench/mla_torch.py.
//
// Usage: attnserve_mla_bench [--only=WORKLOAD[,...]]
// Prints one "RESULT key=value ..." line per workload, then a table.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/check_cuda.h"
#include "bench/gpu_spin.h"
#include "kernels/mla/mla_cuda.h"
#include "kernels/plan/mla_plan.h"
#include "kernels/variant.h"

namespace attnserve {
namespace {

struct Workload {
  const char* name;
  int32_t batch, q_len, kv_len, heads, page_size;
  const char* target;  // the "must reach"
  // Plan overrides (0: the device's): the small tile's key block and CTAs an SM.
  int32_t small_key_block = 0;
  int32_t small_ctas_per_sm = 0;
  int32_t key_block = 0;  // the large tile's (32: the mma.sync kernel on sm_90)
};

const Workload kWorkloads[] = {
    {"decode_h128", 64, 1, 4096, 128, 64, ">= 450 TFLOP/s"},
    {"decode_h128_ps1", 64, 1, 4096, 128, 1, "within 10% of page_size 64"},
    {"decode_h16", 64, 1, 4096, 16, 64, ">= 3.2 TB/s"},
    {"prefill_h128", 8, 4096, 4096, 128, 64, ">= 400 TFLOP/s"},
    // The other small tiles at 16 heads (the H200 takes 16 x 32 at two CTAs
    // an SM): 16 x 64 and 16 x 32 at one.
    {"decode_h16_16x64", 64, 1, 4096, 16, 64, ">= 3.2 TB/s", 64, 1},
    {"decode_h16_16x32_1cta", 64, 1, 4096, 16, 64, ">= 3.2 TB/s", 32, 1},
    // The mma.sync kernel's 64 x 32 beside the wgmma kernel's 64 x 64 (the
    // large tile on sm_90).
    {"decode_h128_64x32", 64, 1, 4096, 128, 64, ">= 450 TFLOP/s", 0, 0, 32},
    {"prefill_h128_64x32", 8, 4096, 4096, 128, 64, ">= 400 TFLOP/s", 0, 0, 32},
};

double MedianMs(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Run(const Workload& w) {
  KvGeometry g;
  g.num_layers = 1;
  g.page_size = w.page_size;
  const int64_t pages_per_seq = (w.kv_len + w.page_size - 1) / w.page_size;
  g.num_pages = static_cast<int32_t>(pages_per_seq * w.batch);
  g.num_qo_heads = w.heads;
  g.num_kv_heads = 1;
  g.attention = AttentionKind::kMla;
  g.kv_lora_rank = kMlaKvLoraRank;
  g.qk_rope_head_dim = kMlaRopeDim;
  g.head_dim = kMlaKvLoraRank + kMlaRopeDim;
  g.dtype = KvDType::kBf16;
  std::mt19937_64 rng(1);
  std::vector<int32_t> indices(g.num_pages);
  for (int32_t i = 0; i < g.num_pages; ++i) indices[i] = i;
  std::shuffle(indices.begin(), indices.end(), rng);
  std::vector<PrefillSeq> seqs(w.batch);
  double pairs = 0;
  for (int32_t b = 0; b < w.batch; ++b) {
    PrefillSeq& s = seqs[b];
    s.q_start = b * w.q_len;
    s.q_len = w.q_len;
    s.kv_start = static_cast<int32_t>(b * pages_per_seq);
    s.kv_len = w.kv_len;
    s.sm_scale = 0.0722f;
    s.causal = 1;
    pairs += static_cast<double>(VisiblePairs(s));
  }
  const int64_t total_q = int64_t{w.batch} * w.q_len;
  MlaPlan plan;
  MlaPlanOptions options = MlaPlanOptionsForDevice();
  if (w.small_key_block > 0) options.small_key_block = w.small_key_block;
  if (w.small_ctas_per_sm > 0) options.small_ctas_per_sm = w.small_ctas_per_sm;
  if (w.key_block > 0) options.key_block = w.key_block;
  BuildMlaPlan(seqs.data(), w.batch, g, options, &plan);

  const size_t pool_bytes = size_t(g.PoolElems()) * 2;
  const size_t q_bytes = size_t(total_q) * g.QRowElems() * 2;
  void *k, *q, *o, *copy_dst;
  float *lse, *part_o = nullptr, *part_lse = nullptr;
  int32_t* d_indices;
  PrefillSeq* d_seqs;
  MlaWorkItem* d_items;
  MlaMergeTile* d_merges = nullptr;
  CHECK_CUDA(cudaMalloc(&k, pool_bytes));
  CHECK_CUDA(cudaMalloc(&copy_dst, pool_bytes));
  CHECK_CUDA(cudaMalloc(&q, q_bytes));
  CHECK_CUDA(cudaMalloc(&o, size_t(total_q) * g.ORowElems() * 2));
  CHECK_CUDA(cudaMalloc(&lse, size_t(total_q) * w.heads * 4));
  CHECK_CUDA(cudaMalloc(&d_indices, indices.size() * 4));
  CHECK_CUDA(cudaMalloc(&d_seqs, seqs.size() * sizeof(PrefillSeq)));
  CHECK_CUDA(cudaMalloc(&d_items, plan.items.size() * sizeof(MlaWorkItem)));
  if (!plan.merges.empty()) {
    CHECK_CUDA(cudaMalloc(&d_merges, plan.merges.size() * sizeof(MlaMergeTile)));
    CHECK_CUDA(cudaMalloc(&part_o, size_t(plan.partial_slots) * plan.tile_rows * g.VDim() * 4));
    CHECK_CUDA(cudaMalloc(&part_lse, size_t(plan.partial_slots) * plan.tile_rows * 4));
    CHECK_CUDA(cudaMemcpy(d_merges, plan.merges.data(), plan.merges.size() * sizeof(MlaMergeTile),
                          cudaMemcpyHostToDevice));
  }
  // Small random values (bf16 bits of about N(0, 0.5)): 0x3e00..0x3eff and sign.
  std::vector<uint16_t> host(std::max(pool_bytes, q_bytes) / 2);
  for (auto& x : host) x = static_cast<uint16_t>(0x3e00 | (rng() & 0x80ff));
  CHECK_CUDA(cudaMemcpy(k, host.data(), pool_bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(q, host.data(), q_bytes, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_indices, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_seqs, seqs.data(), seqs.size() * sizeof(PrefillSeq),
                        cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_items, plan.items.data(), plan.items.size() * sizeof(MlaWorkItem),
                        cudaMemcpyHostToDevice));
  PagedPrefillParams p;
  p.q = q;
  p.o = o;
  p.lse = lse;
  p.k_cache = k;
  p.v_cache = k;
  p.kv_indices = d_indices;
  p.seqs = d_seqs;
  p.num_seqs = w.batch;
  p.total_q = static_cast<int32_t>(total_q);
  p.geo = g;
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  auto time = [&](auto&& fn) {
    std::vector<double> ms;
    for (int i = 0; i < 25; ++i) {
      CHECK_CUDA(LaunchGpuSpin(50));
      CHECK_CUDA(cudaEventRecord(start));
      fn();
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
      if (i >= 5) ms.push_back(t);
    }
    return MedianMs(ms);
  };
  const double mla_ms = time([&] {
    CHECK_CUDA(PagedMlaCuda(p, plan.tile_rows, plan.key_block, d_items, static_cast<int32_t>(plan.items.size()),
                            part_o, part_lse, nullptr));
    CHECK_CUDA(MergeMlaCuda(p, plan.tile_rows, d_merges, static_cast<int32_t>(plan.merges.size()),
                            part_o, part_lse, nullptr));
  });
  const double copy_ms =
      time([&] { CHECK_CUDA(cudaMemcpyAsync(copy_dst, k, pool_bytes, cudaMemcpyDeviceToDevice)); });
  const double flops = 2.0 * (576 + 512) * w.heads * pairs;
  const double bytes = double(w.batch) * w.kv_len * 1152;
  std::printf(
      "RESULT workload=%s ms=%.4f tflops=%.1f latent_tbps=%.3f copy_tbps=%.3f items=%zu "
      "splits=%zu tile_rows=%d key_block=%d target=\"%s\"\n",
      w.name, mla_ms, flops / mla_ms / 1e9, bytes / mla_ms / 1e9,
      2.0 * pool_bytes / copy_ms / 1e9, plan.items.size(), plan.merges.size(), plan.tile_rows,
      plan.key_block, w.target);
  for (void* ptr : {k, q, o, copy_dst}) cudaFree(ptr);
  cudaFree(lse);
  cudaFree(d_indices);
  cudaFree(d_seqs);
  cudaFree(d_items);
  cudaFree(d_merges);
  cudaFree(part_o);
  cudaFree(part_lse);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--only=", 7) == 0) only = std::string(",") + (argv[i] + 7) + ",";
  }
  for (const attnserve::Workload& w : attnserve::kWorkloads) {
    if (!only.empty() && only.find(std::string(",") + w.name + ",") == std::string::npos) continue;
    attnserve::Run(w);
  }
  return 0;
}
