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
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/kv_geometry.h"
#include "common/reference.h"
#include "gtest/gtest.h"
#include "kernels/fp8.h"
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
  // (sets, num_qo_heads) sink logits, natural units: a sequence's sink_index
  // names its set (PagedPrefillParams::sinks).
  std::vector<float> sinks;
  int32_t total_q = 0;
  // FP8 batches (geo.kv_fp8, QuantizePools): the pools as stored, and their
  // (num_layers, num_kv_heads) scales; k_pool / v_pool are then unused.
  std::vector<uint8_t> k8, v8;
  std::vector<float> k_scales, v_scales;
};

// Makes b an FP8 batch of `format`: draws scales (per layer, or per KV head
// when per_head; around 2^-4 .. 2^2, so that they matter) and quantizes the
// 16-bit pools with them by kernels/fp8.h's quantizer (the reference decodes
// the stored bytes on its own). Elements are N(0, 1) and stored as x /
// scale: the larger scales put small values among E4M3's subnormals.
inline void QuantizePools(HostBatch* b, Fp8Format format, bool per_head, std::mt19937_64* rng) {
  KvGeometry& g = b->geo;
  g.kv_fp8 = format;
  const int64_t n = int64_t{g.num_layers} * g.num_kv_heads;
  std::uniform_real_distribution<float> u(-4.f, 2.f);
  b->k_scales.assign(n, 1.f);
  b->v_scales.assign(n, 1.f);
  for (int64_t i = 0; i < n; ++i) {
    if (per_head || i % g.num_kv_heads == 0) {
      b->k_scales[i] = std::exp2(u(*rng));
      b->v_scales[i] = std::exp2(u(*rng));
    } else {
      b->k_scales[i] = b->k_scales[i - 1];
      b->v_scales[i] = b->v_scales[i - 1];
    }
  }
  const int64_t row = g.RowElems();
  b->k8.resize(b->k_pool.size());
  b->v8.resize(b->v_pool.size());
  for (size_t e = 0; e < b->k_pool.size(); ++e) {
    const int64_t layer = int64_t(e / row) / g.SlotsPerLayer();
    const int64_t si = layer * g.num_kv_heads + int64_t(e % row) / g.head_dim;
    b->k8[e] = Fp8Quantize(format, float(FromHalfBits(g.dtype, b->k_pool[e])), b->k_scales[si]);
    b->v8[e] = Fp8Quantize(format, float(FromHalfBits(g.dtype, b->v_pool[e])), b->v_scales[si]);
  }
  b->k_pool.clear();
  b->v_pool.clear();
}

// Adds a set of random sink logits (natural units, around the rows' own
// LSEs, so that the sink moves both O and the LSE) and returns its index.
inline int32_t AddSinkSet(HostBatch* b, std::mt19937_64* rng) {
  std::uniform_real_distribution<float> u(-2.f, 6.f);
  const int32_t set = static_cast<int32_t>(b->sinks.size() / b->geo.num_qo_heads);
  for (int h = 0; h < b->geo.num_qo_heads; ++h) b->sinks.push_back(u(*rng));
  return set;
}

// Fills v with N(0, scale) values in dt (never all zeros): each element is
// one of 2^16 values drawn once per (dtype, scale) from a normal
// distribution, picked by 16 bits of rng (four elements per 64-bit draw).
// A per-element normal draw and conversion took seconds per pool of 25M
// elements, most of some tests' time.
inline void FillRandom(std::vector<uint16_t>* v, KvDType dt, float scale, std::mt19937_64* rng) {
  struct Table {
    KvDType dt;
    float scale;
    std::vector<uint16_t> bits;
  };
  static std::vector<Table> tables;
  const Table* table = nullptr;
  for (const Table& t : tables) {
    if (t.dt == dt && t.scale == scale) table = &t;
  }
  if (table == nullptr) {
    Table t{dt, scale, std::vector<uint16_t>(size_t{1} << 16)};
    std::mt19937_64 table_rng(0x5eed + tables.size());
    std::normal_distribution<float> nd(0.f, scale);
    for (auto& x : t.bits) x = ToHalfBits(dt, nd(table_rng));
    tables.push_back(std::move(t));
    table = &tables.back();
  }
  const uint16_t* bits = table->bits.data();
  const size_t n = v->size();
  uint16_t* out = v->data();
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint64_t r = (*rng)();
    out[i] = bits[r & 0xffff];
    out[i + 1] = bits[(r >> 16) & 0xffff];
    out[i + 2] = bits[(r >> 32) & 0xffff];
    out[i + 3] = bits[r >> 48];
  }
  for (; i < n; ++i) out[i] = bits[(*rng)() & 0xffff];
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
// fp8_query_min_rows > 0: sequences of at least that many query rows are
// computed on their rows rounded as the FP8-query kernel rounds them
// (reference::Seq::fp8_queries), as a server that reports that
// ServerInfo.fp8_query_min_rows does. lse_bound (optional): each LSE's
// bound for a kernel's result (reference::Prefill's).
inline void Reference(const HostBatch& b, std::vector<double>* o, std::vector<double>* lse,
                      int fp8_query_min_rows = 0, std::vector<double>* lse_bound = nullptr) {
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
    r.window_left = s.window_left;
    r.soft_cap = s.soft_cap;
    r.sinks = s.sink_index >= 0 ? b.sinks.data() + int64_t{s.sink_index} * b.geo.num_qo_heads : nullptr;
    r.lse_base_e = s.lse_base_e != 0;
    r.fp8_queries = fp8_query_min_rows > 0 && s.q_len >= fp8_query_min_rows;
    seqs.push_back(r);
  }
  const int threads =
      static_cast<int>(std::max(1u, std::min(32u, std::thread::hardware_concurrency())));
  const bool fp8 = b.geo.KvIsFp8();
  reference::Prefill(b.geo,
                     fp8 ? reference::HostPools(b.geo, b.k8.data(), b.v8.data(), b.k_scales.data(),
                                                b.v_scales.data())
                         : reference::HostPools(b.geo, b.k_pool.data(), b.v_pool.data()),
                     b.q.data(), b.total_q, b.kv_indices, seqs, o, lse, threads, lse_bound);
}

// Reference() of a batch, computed once per distinct batch: every kernel
// family of a parameterized test draws the same batches from the same seeds,
// so the families after the first reuse the reference (matched by the
// batch's full contents, not by the seed). Holds up to kCacheBytes of
// results, dropping the oldest first. fp8_query_min_rows as Reference's.
struct ReferenceResult {
  std::vector<double> o, lse;
  std::vector<double> lse_bound;  // each LSE's bound (Reference's lse_bound)
};
inline std::shared_ptr<const ReferenceResult> CachedReference(const HostBatch& b, int fp8_query_min_rows = 0) {
  constexpr size_t kCacheBytes = size_t{8} << 30;
  struct Entry {
    uint64_t key[2];
    std::vector<uint16_t> q;  // kept to compare exactly on a key match
    std::shared_ptr<const ReferenceResult> result;
  };
  static std::deque<Entry> cache;
  static size_t cached_bytes = 0;
  // Two 64-bit hashes over the geometry, the sequences, the page table, Q
  // and both pools.
  uint64_t h1 = 1469598103934665603ull, h2 = 0x9e3779b97f4a7c15ull;
  auto mix = [&](const void* data, size_t bytes) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      h1 = (h1 ^ w) * 1099511628211ull;
      h2 = (h2 + w) * 0xff51afd7ed558ccdull;
      h2 ^= h2 >> 29;
    }
    for (; i < bytes; ++i) {
      h1 = (h1 ^ p[i]) * 1099511628211ull;
      h2 = (h2 + p[i] + 1) * 0xc4ceb9fe1a85ec53ull;
    }
    h1 ^= bytes;
    h2 ^= bytes * 31;
  };
  const int64_t geo[] = {b.geo.num_layers, b.geo.num_pages, b.geo.page_size, b.geo.num_qo_heads,
                         b.geo.num_kv_heads, b.geo.head_dim, static_cast<int64_t>(b.geo.dtype), b.total_q,
                         static_cast<int64_t>(b.geo.kv_fp8), fp8_query_min_rows};
  mix(geo, sizeof(geo));
  for (const PrefillSeq& s : b.seqs) {
    const double f[] = {double(s.q_start), double(s.q_len), double(s.kv_start), double(s.kv_len),
                        double(s.layer), double(s.sm_scale), double(s.causal), double(s.causal_shift),
                        double(s.lse_base_e), double(s.window_left), double(s.soft_cap),
                        double(s.sink_index)};
    mix(f, sizeof(f));
  }
  mix(b.sinks.data(), b.sinks.size() * sizeof(float));
  mix(b.kv_indices.data(), b.kv_indices.size() * 4);
  mix(b.q.data(), b.q.size() * 2);
  mix(b.k_pool.data(), b.k_pool.size() * 2);
  mix(b.v_pool.data(), b.v_pool.size() * 2);
  mix(b.k8.data(), b.k8.size());
  mix(b.v8.data(), b.v8.size());
  mix(b.k_scales.data(), b.k_scales.size() * 4);
  mix(b.v_scales.data(), b.v_scales.size() * 4);
  for (const Entry& e : cache) {
    if (e.key[0] == h1 && e.key[1] == h2 && e.q == b.q) return e.result;
  }
  auto res = std::make_shared<ReferenceResult>();
  Reference(b, &res->o, &res->lse, fp8_query_min_rows, &res->lse_bound);
  auto held = [](const ReferenceResult& r, const std::vector<uint16_t>& q) {
    return (r.o.size() + r.lse.size() + r.lse_bound.size()) * 8 + q.size() * 2;
  };
  const size_t bytes = held(*res, b.q);
  while (!cache.empty() && cached_bytes + bytes > kCacheBytes) {
    cached_bytes -= held(*cache.front().result, cache.front().q);
    cache.pop_front();
  }
  if (bytes <= kCacheBytes) {
    cache.push_back(Entry{{h1, h2}, b.q, res});
    cached_bytes += bytes;
  }
  return res;
}

// Relative norm error of 16-bit outputs against a float64 reference's.
inline double OutputRelError(KvDType dt, const std::vector<uint16_t>& o, const std::vector<double>& o_ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < o_ref.size() && i < o.size(); ++i) {
    const double d = FromHalfBits(dt, o[i]) - o_ref[i];
    num += d * d;
    den += o_ref[i] * o_ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Compares (o bits, lse) to the reference; returns an empty string when OK:
// the output's relative norm error below 1e-2 and every LSE within lse_tol
// (1e-3), or with lse_bounds, LSE i within lse_bounds[i] (the reference's
// per-row bounds: the FP8-query kernel's rows are held to its own,
// reference::kFp8QueryLseBound and up).
inline std::string Compare(KvDType dt, const std::vector<uint16_t>& o, const std::vector<float>& lse,
                           const std::vector<double>& o_ref, const std::vector<double>& lse_ref,
                           double lse_tol = 1e-3, const std::vector<double>* lse_bounds = nullptr) {
  for (size_t i = 0; i < o_ref.size(); ++i) {
    if (!std::isfinite(FromHalfBits(dt, o[i]))) return "non-finite output at element " + std::to_string(i);
  }
  const double rel = OutputRelError(dt, o, o_ref);
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
    const double bound = lse_bounds != nullptr ? (*lse_bounds)[i] : lse_tol;
    if (!(std::fabs(lse[i] - lse_ref[i]) < bound)) {
      return "LSE error at row " + std::to_string(i) + ": got " + std::to_string(lse[i]) + " want " +
             std::to_string(lse_ref[i]) + " (bound " + std::to_string(bound) + ")";
    }
  }
  return "";
}

}  // namespace gpu_test
}  // namespace attnserve
