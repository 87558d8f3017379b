// The N-way merge family: one kernel template for both of its callers, the
// split-KV pass of the prefill families (fp32 partial states in the plan's
// workspace) and MergeStates (caller's states in the KV dtype). Each thread
// owns VEC elements of one output (token, head) row; a Source says where the
// row's states live. All of a row's LSE loads are issued before the math, and
// with a compile-time state count all vector loads too, so a thread has every
// state's bytes in flight at once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/math.h"
#include "kernels/merge/merge_cuda.h"
#include "kernels/numerics.cuh"

namespace attnserve {
namespace {

constexpr int kMaxStates = 16;
constexpr int kThreads = 256;

// VEC elements of type E, as loaded: one 16-byte load for 8 16-bit
// elements, two for 8 floats, one element for VEC 1. Loading and converting
// are separate so that every state's load is issued before any is waited on.
template <typename E, int VEC>
struct Raw {
  using Type = typename std::conditional<VEC == 8, typename std::conditional<std::is_same_v<E, float>, float4[2], uint4>::type, E>::type;
  Type v;
};

template <typename E, int VEC>
__device__ __forceinline__ void LoadRaw(const E* p, Raw<E, VEC>& r) {
  if constexpr (VEC == 8 && std::is_same_v<E, float>) {
    r.v[0] = __ldg(reinterpret_cast<const float4*>(p));
    r.v[1] = __ldg(reinterpret_cast<const float4*>(p) + 1);
  } else if constexpr (VEC == 8) {
    r.v = __ldg(reinterpret_cast<const uint4*>(p));
  } else if constexpr (std::is_same_v<E, float>) {
    r.v = __ldg(p);
  } else {
    r.v = p[0];
  }
}

template <typename E, int VEC>
__device__ __forceinline__ void ToFloats(const Raw<E, VEC>& r, float (&v)[VEC]) {
  if constexpr (VEC == 8 && std::is_same_v<E, float>) {
    v[0] = r.v[0].x; v[1] = r.v[0].y; v[2] = r.v[0].z; v[3] = r.v[0].w;
    v[4] = r.v[1].x; v[5] = r.v[1].y; v[6] = r.v[1].z; v[7] = r.v[1].w;
  } else if constexpr (VEC == 8) {
    const E* e = reinterpret_cast<const E*>(&r.v);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = ToFloat<E>(e[i]);
  } else if constexpr (std::is_same_v<E, float>) {
    v[0] = r.v;
  } else {
    v[0] = ToFloat<E>(r.v);
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void StoreVec(T* dst, const float (&acc)[VEC], float inv) {
  if constexpr (VEC == 8) {
    uint4 out;
    out.x = Pack2<T>(acc[0] * inv, acc[1] * inv);
    out.y = Pack2<T>(acc[2] * inv, acc[3] * inv);
    out.z = Pack2<T>(acc[4] * inv, acc[5] * inv);
    out.w = Pack2<T>(acc[6] * inv, acc[7] * inv);
    *reinterpret_cast<uint4*>(dst) = out;
  } else {
    dst[0] = FromFloat<T>(acc[0] * inv);
  }
}

// MergeStates: num_states caller arrays of (n, h, d) values and (n, h) LSEs.
// Pointers travel by value: no dependent pointer loads in the kernel.
template <typename T>
struct StateArrays {
  using Elem = T;
  const void* v[kMaxStates];
  const float* lse[kMaxStates];
  int32_t num_states;
  int32_t base_e;
};

// Split-KV: the fp32 partial states of the plan's split sequences. Row r of
// the output space is (row, head) pair r of the merges, in order.
struct SplitPartials {
  using Elem = float;
  const SplitMergeSeq* merges;
  int32_t num_merges;
  int32_t num_qo_heads;
  const float* part_o;
  const float* part_lse;
  // The merge holding pair `row`, found by binary search on pair_begin.
  __device__ __forceinline__ const SplitMergeSeq& Find(int64_t row) const {
    int lo = 0, hi = num_merges - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (merges[mid].pair_begin <= row) lo = mid; else hi = mid - 1;
    }
    return merges[lo];
  }
};

// The merge of one row chunk, for either source: m = max lse, w_s =
// 2^(lse_s - m), out = sum w_s v_s / sum w_s, lse = m + log2(sum w_s). -inf
// states add nothing; all -inf gives 0 and -inf.
template <typename T, int VEC, int NS, typename Src>
__global__ void __launch_bounds__(kThreads) MergeKernel(const Src src, int64_t rows, int32_t d, T* v_out,
                                                        float* lse_out) {
  using E = typename Src::Elem;
  const int chunks = d / VEC;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t row = idx / chunks;
  if (row >= rows) return;
  const int c = static_cast<int>(idx - row * chunks);

  // Where this row's states are.
  int32_t count;
  const float* lse_base;
  const E* v_base;
  int64_t stride;     // between states, in rows
  float to2;
  int64_t out_row;
  bool out_base_e;
  if constexpr (std::is_same_v<Src, SplitPartials>) {
    const SplitMergeSeq& ms = src.Find(row);
    const int64_t local = row - ms.pair_begin;
    count = ms.num_chunks;
    stride = int64_t{ms.q_len} * src.num_qo_heads;
    lse_base = src.part_lse + ms.part_off + local;
    v_base = src.part_o + (ms.part_off + local) * d;
    to2 = 1.f;
    const int64_t t = local / src.num_qo_heads;
    out_row = (ms.q_start + t) * src.num_qo_heads + (local - t * src.num_qo_heads);
    out_base_e = ms.lse_base_e != 0;
  } else {
    count = src.num_states;
    stride = 0;
    lse_base = nullptr;
    v_base = nullptr;
    to2 = src.base_e ? kLog2e : 1.f;
    out_row = row;
    out_base_e = src.base_e != 0;
  }
  auto lse_of = [&](int s) -> float {
    if constexpr (std::is_same_v<Src, SplitPartials>) {
      return __ldg(lse_base + s * stride);
    } else {
      return __ldg(src.lse[s] + row) * to2;
    }
  };
  auto v_of = [&](int s) -> const E* {
    if constexpr (std::is_same_v<Src, SplitPartials>) {
      return v_base + s * stride * d + c * VEC;
    } else {
      return static_cast<const E*>(src.v[s]) + row * d + c * VEC;
    }
  };

  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  float m = -INFINITY;
  float wsum = 0.f;
  if constexpr (NS > 0) {
    // Compile-time count: every LSE, then every vector, in flight at once.
    float l[NS];
#pragma unroll
    for (int s = 0; s < NS; ++s) l[s] = lse_of(s);
    Raw<E, VEC> raw[NS];
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      if (l[s] != -INFINITY) LoadRaw<E, VEC>(v_of(s), raw[s]);
    }
#pragma unroll
    for (int s = 0; s < NS; ++s) m = fmaxf(m, l[s]);
    if (m != -INFINITY) {
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        if (l[s] == -INFINITY) continue;
        const float w = exp2f(l[s] - m);
        wsum += w;
        float v[VEC];
        ToFloats<E, VEC>(raw[s], v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += w * v[i];
      }
    }
  } else {
    for (int s = 0; s < count; ++s) m = fmaxf(m, lse_of(s));
    if (m != -INFINITY) {
      for (int s = 0; s < count; ++s) {
        const float l = lse_of(s);
        if (l == -INFINITY) continue;
        const float w = exp2f(l - m);
        wsum += w;
        Raw<E, VEC> raw;
        LoadRaw<E, VEC>(v_of(s), raw);
        float v[VEC];
        ToFloats<E, VEC>(raw, v);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += w * v[i];
      }
    }
  }
  StoreVec<T, VEC>(v_out + out_row * d + c * VEC, acc, wsum > 0.f ? 1.f / wsum : 0.f);
  if (c == 0) {
    float out = -INFINITY;
    if (wsum > 0.f) out = (m + log2f(wsum)) * (out_base_e ? kLn2 : 1.f);
    lse_out[out_row] = out;
  }
}

template <typename T, int VEC, int NS, typename Src>
cudaError_t Launch(const Src& src, int64_t rows, int32_t d, void* v_out, float* lse_out,
                   cudaStream_t stream) {
  const int64_t threads = rows * (d / VEC);
  if (threads == 0) return cudaSuccess;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  MergeKernel<T, VEC, NS, Src><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      src, rows, d, static_cast<T*>(v_out), lse_out);
  return cudaGetLastError();
}

template <typename T>
cudaError_t MergeStatesT(const MergeStatesParams& p, cudaStream_t stream) {
  StateArrays<T> src = {};
  for (int s = 0; s < p.num_states; ++s) {
    src.v[s] = p.v[s];
    src.lse[s] = p.lse[s];
  }
  src.num_states = p.num_states;
  src.base_e = p.lse_base_e;
  const int64_t rows = p.n * p.h;
  if (p.d % 8 != 0) return Launch<T, 1, 0>(src, rows, p.d, p.v_out, p.lse_out, stream);
  switch (p.num_states) {
    case 2: return Launch<T, 8, 2>(src, rows, p.d, p.v_out, p.lse_out, stream);
    case 3: return Launch<T, 8, 3>(src, rows, p.d, p.v_out, p.lse_out, stream);
    case 4: return Launch<T, 8, 4>(src, rows, p.d, p.v_out, p.lse_out, stream);
    default: return Launch<T, 8, 0>(src, rows, p.d, p.v_out, p.lse_out, stream);
  }
}

}  // namespace

cudaError_t MergeStatesCuda(const MergeStatesParams& p, cudaStream_t stream) {
  if (p.num_states < 0 || p.num_states > kMaxStates || p.d <= 0 || p.h < 0 || p.n < 0) return cudaErrorInvalidValue;
  return p.dtype == KvDType::kBf16 ? MergeStatesT<__nv_bfloat16>(p, stream) : MergeStatesT<__half>(p, stream);
}

cudaError_t MergeSplitsCuda(const PagedPrefillParams& params, const SplitMergeSeq* merges,
                            int32_t num_merges, int32_t merge_pairs, const float* part_o,
                            const float* part_lse, cudaStream_t stream) {
  if (merge_pairs == 0) return cudaSuccess;
  if (params.geo.head_dim % 8 != 0 || num_merges <= 0) return cudaErrorInvalidValue;
  SplitPartials src;
  src.merges = merges;
  src.num_merges = num_merges;
  src.num_qo_heads = params.geo.num_qo_heads;
  src.part_o = part_o;
  src.part_lse = part_lse;
  if (params.geo.dtype == KvDType::kBf16) {
    return Launch<__nv_bfloat16, 8, 0>(src, merge_pairs, params.geo.head_dim, params.o, params.lse, stream);
  }
  return Launch<__half, 8, 0>(src, merge_pairs, params.geo.head_dim, params.o, params.lse, stream);
}

}  // namespace attnserve
