// Shared pieces of the GPU tests: a float64 attention reference, random
// ragged batches over a host copy of the paged pools, and the comparison
// rules of docs/design.md section 3 (relative norm error < 1e-2 per tensor, LSE
// abs error < 1e-3 on finite rows, exact -inf agreement, no NaN anywhere).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/kv_geometry.h"
#include "gtest/gtest.h"
#include "kernels/paged_prefill.h"

namespace attnserve {
namespace gpu_test {

inline int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

#define ATTNSERVE_SKIP_WITHOUT_GPU()                                          \
  do {                                                                        \
    if (::attnserve::gpu_test::DeviceCount() == 0) GTEST_SKIP() << "skipped: no GPU"; \
  } while (0)

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(expr)

inline uint16_t ToHalfBits(KvDType dt, float x) {
  if (dt == KvDType::kBf16) {
    __nv_bfloat16 b = __float2bfloat16_rn(x);
    uint16_t u;
    std::memcpy(&u, &b, 2);
    return u;
  }
  __half h = __float2half_rn(x);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

inline double FromHalfBits(KvDType dt, uint16_t u) {
  if (dt == KvDType::kBf16) {
    __nv_bfloat16 b;
    std::memcpy(&b, &u, 2);
    return __bfloat162float(b);
  }
  __half h;
  std::memcpy(&h, &u, 2);
  return __half2float(h);
}

// A random batch with its own host copy of the pools.
struct HostBatch {
  KvGeometry geo;
  std::vector<uint16_t> k_pool, v_pool;  // (L, pages, ps, KVH, D)
  std::vector<uint16_t> q;               // (total_q, H, D)
  std::vector<PrefillSeq> seqs;          // q_start / kv_start batch-global
  std::vector<int32_t> kv_indices;
  int32_t total_q = 0;
};

inline void FillRandom(std::vector<uint16_t>* v, KvDType dt, float scale, std::mt19937_64* rng) {
  std::normal_distribution<float> nd(0.f, scale);
  for (auto& x : *v) x = ToHalfBits(dt, nd(*rng));
}

// Adds a sequence: q_len rows, kv_len tokens on random pages (shuffled,
// sometimes repeated).
inline void AddSeq(HostBatch* b, int q_len, int kv_len, int layer, bool causal, bool base_e,
                   float scale, std::mt19937_64* rng) {
  PrefillSeq s;
  s.q_start = b->total_q;
  s.q_len = q_len;
  s.kv_start = static_cast<int32_t>(b->kv_indices.size());
  s.kv_len = kv_len;
  s.layer = layer;
  s.sm_scale = scale;
  s.causal = causal;
  s.lse_base_e = base_e;
  const int ps = b->geo.page_size;
  const int pages = (kv_len + ps - 1) / ps;
  std::uniform_int_distribution<int> pick(0, b->geo.num_pages - 1);
  const bool repeat = ((*rng)() % 4) == 0;
  std::vector<int> perm(b->geo.num_pages);
  for (int i = 0; i < b->geo.num_pages; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), *rng);
  for (int p = 0; p < pages; ++p) {
    b->kv_indices.push_back(repeat || pages > b->geo.num_pages ? pick(*rng) : perm[p]);
  }
  b->seqs.push_back(s);
  b->total_q += q_len;
}

inline void FinishBatch(HostBatch* b, float q_scale, std::mt19937_64* rng) {
  b->q.resize(size_t(b->total_q) * b->geo.num_qo_heads * b->geo.head_dim);
  FillRandom(&b->q, b->geo.dtype, q_scale, rng);
}

inline void MakePools(HostBatch* b, std::mt19937_64* rng) {
  b->k_pool.resize(b->geo.PoolElems());
  b->v_pool.resize(b->geo.PoolElems());
  FillRandom(&b->k_pool, b->geo.dtype, 1.f, rng);
  FillRandom(&b->v_pool, b->geo.dtype, 1.f, rng);
}

// float64 reference: o (total_q, H, D), lse (total_q, H) in each seq's base.
inline void Reference(const HostBatch& b, std::vector<double>* o, std::vector<double>* lse) {
  const KvGeometry& g = b.geo;
  const int H = g.num_qo_heads, KVH = g.num_kv_heads, D = g.head_dim, ps = g.page_size;
  const int group = H / KVH;
  o->assign(size_t(b.total_q) * H * D, 0.0);
  lse->assign(size_t(b.total_q) * H, -INFINITY);
  std::vector<std::pair<int, int>> work;  // (seq, head)
  for (int s = 0; s < static_cast<int>(b.seqs.size()); ++s) {
    for (int h = 0; h < H; ++h) work.push_back({s, h});
  }
  auto run = [&](size_t begin, size_t step) {
    std::vector<double> kd, vd, score, qd;
    for (size_t w = begin; w < work.size(); w += step) {
      const PrefillSeq& s = b.seqs[work[w].first];
      const int h = work[w].second;
      const int kvh = h / group;
      kd.assign(size_t(s.kv_len) * D, 0.0);
      vd.assign(size_t(s.kv_len) * D, 0.0);
      for (int j = 0; j < s.kv_len; ++j) {
        const int64_t slot = int64_t{b.kv_indices[s.kv_start + j / ps]} * ps + j % ps;
        const int64_t base = ((int64_t{s.layer} * g.SlotsPerLayer() + slot) * KVH + kvh) * D;
        for (int d = 0; d < D; ++d) {
          kd[size_t(j) * D + d] = FromHalfBits(g.dtype, b.k_pool[base + d]);
          vd[size_t(j) * D + d] = FromHalfBits(g.dtype, b.v_pool[base + d]);
        }
      }
      score.resize(s.kv_len);
      for (int t = 0; t < s.q_len; ++t) {
        const int64_t row = int64_t{s.q_start + t} * H + h;
        qd.resize(D);
        for (int d = 0; d < D; ++d) qd[d] = FromHalfBits(g.dtype, b.q[row * D + d]);
        int vis = s.kv_len;
        if (s.causal) vis = std::min(vis, std::max(0, t + s.kv_len - s.q_len + s.causal_shift + 1));
        if (vis <= 0) continue;
        double mx = -INFINITY;
        for (int j = 0; j < vis; ++j) {
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += qd[d] * kd[size_t(j) * D + d];
          score[j] = acc * s.sm_scale;
          mx = std::max(mx, score[j]);
        }
        double sum = 0;
        for (int j = 0; j < vis; ++j) {
          score[j] = std::exp(score[j] - mx);
          sum += score[j];
        }
        double* orow = &(*o)[row * D];
        for (int j = 0; j < vis; ++j) {
          const double p = score[j] / sum;
          for (int d = 0; d < D; ++d) orow[d] += p * vd[size_t(j) * D + d];
        }
        const double ln = mx + std::log(sum);
        (*lse)[row] = s.lse_base_e ? ln : ln / std::log(2.0);
      }
    }
  };
  const size_t nt = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < nt; ++i) threads.emplace_back(run, i, nt);
  for (auto& t : threads) t.join();
}

// Compares (o bits, lse) to the reference; returns an empty string when OK.
inline std::string Compare(KvDType dt, const std::vector<uint16_t>& o, const std::vector<float>& lse,
                           const std::vector<double>& o_ref, const std::vector<double>& lse_ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < o_ref.size(); ++i) {
    const double x = FromHalfBits(dt, o[i]);
    if (!std::isfinite(x)) return "non-finite output at element " + std::to_string(i);
    num += (x - o_ref[i]) * (x - o_ref[i]);
    den += o_ref[i] * o_ref[i];
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  if (!(rel < 1e-2)) return "output relative norm error " + std::to_string(rel);
  for (size_t i = 0; i < lse_ref.size(); ++i) {
    if (std::isnan(lse[i])) return "NaN LSE at row " + std::to_string(i);
    if (std::isinf(lse_ref[i]) || std::isinf(lse[i])) {
      if (!(std::isinf(lse_ref[i]) && std::isinf(lse[i]) && lse[i] < 0 && lse_ref[i] < 0)) {
        return "LSE -inf disagreement at row " + std::to_string(i) + ": got " + std::to_string(lse[i]) +
               " want " + std::to_string(lse_ref[i]);
      }
      continue;
    }
    if (!(std::fabs(lse[i] - lse_ref[i]) < 1e-3)) {
      return "LSE error at row " + std::to_string(i) + ": got " + std::to_string(lse[i]) + " want " +
             std::to_string(lse_ref[i]);
    }
  }
  return "";
}

}  // namespace gpu_test
}  // namespace attnserve
