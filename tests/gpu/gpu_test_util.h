// Shared pieces of the GPU tests: common/reference.h's float64 reference, random
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
#include "common/reference.h"
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

// The float64 reference of common/reference.h: o (total_q, H, D), lse
// (total_q, H) in each seq's base; split over up to 32 threads.
inline void Reference(const HostBatch& b, std::vector<double>* o, std::vector<double>* lse) {
  std::vector<reference::Seq> seqs;
  for (const PrefillSeq& s : b.seqs) {
    reference::Seq r;
    r.q_start = s.q_start;
    r.q_len = s.q_len;
    r.kv_start = s.kv_start;
    r.kv_len = s.kv_len;
    r.layer = s.layer;
    r.sm_scale = s.sm_scale;
    r.causal = s.causal != 0;
    r.causal_shift = s.causal_shift;
    r.lse_base_e = s.lse_base_e != 0;
    seqs.push_back(r);
  }
  const int threads =
      static_cast<int>(std::max(1u, std::min(32u, std::thread::hardware_concurrency())));
  reference::Prefill(b.geo, reference::HostPools(b.geo, b.k_pool.data(), b.v_pool.data()),
                     b.q.data(), b.total_q, b.kv_indices, seqs, o, lse, threads);
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
