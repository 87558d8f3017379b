// The end of a decode CTA (kernels/decode/decode_kernel.cuh), once its
// warps' states are combined in shared memory: each warp's O scaled by its
// rows' factors (s_o: (warps, M, kOStride) fp32) and each row's base-2 LSE
// (s_lse). An unsplit item writes its rows (WriteRows); in cluster mode the
// CTAs of a tile merge through distributed shared memory (MergeCluster);
// a split chunk writes an fp32 partial (WritePartial), counts itself done
// (LastChunk), and the tile's last chunk merges the partials in chunk order
// (MergePartials: the answer does not depend on which CTA finished last).
#pragma once

#include <cooperative_groups.h>

#include <cmath>
#include <cstdint>

#include "kernels/decode/traits.cuh"
#include "kernels/math.h"
#include "kernels/sm80/mma.cuh"

namespace attnserve {
namespace decode {

// What the epilogue reads: the combined states and where the tile's rows go.
template <int D, typename Tr, typename T>
struct TileOut {
  static constexpr int kM = Tr::kM;
  const DecodeKernelArgs& args;
  const DecodeWorkItem& item;
  uint8_t* smem;        // the CTA's shared memory (s_o at its start)
  const float* s_lse;   // (M) each row's base-2 LSE
  float* s_row_m;       // (M) scratch of the merge
  int* s_last;          // the last-chunk flag
  int tid, warp, lane;
  int group;            // query heads a KV head

  __device__ __forceinline__ T* Out() const { return static_cast<T*>(args.p.o); }
  // Rows of the tile that hold a query row (the rest is padding).
  __device__ __forceinline__ int ValidRows() const {
    return min(kM, item.seq_info.q_len * group - item.row_begin);
  }
  // Packed row r's (query row, head) index in o and lse; -1 for padding.
  __device__ __forceinline__ int64_t Row(int r) const {
    const int pr = item.row_begin + r;
    const int t = pr / group;
    if (t >= item.seq_info.q_len) return -1;
    return static_cast<int64_t>(item.seq_info.q_start + t) * args.p.geo.num_qo_heads + item.kv_head * group +
           (pr - t * group);
  }
  __device__ __forceinline__ void WriteLse(int64_t row, float lse2) const {
    args.p.lse[row] = (item.seq_info.lse_base_e && lse2 != -INFINITY) ? lse2 * kLn2 : lse2;
  }
  // Sum over warps of 8 consecutive values of row r starting at column c8 * 8.
  __device__ __forceinline__ void SumWarps(int r, int c8, float (&v)[8]) const {
    const float* s_o = reinterpret_cast<const float*>(smem);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.f;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float* src = s_o + (w * kM + r) * Tr::kOStride + c8 * 8;
      const float4 a = *reinterpret_cast<const float4*>(src);
      const float4 b = *reinterpret_cast<const float4*>(src + 4);
      v[0] += a.x; v[1] += a.y; v[2] += a.z; v[3] += a.w;
      v[4] += b.x; v[5] += b.y; v[6] += b.z; v[7] += b.w;
    }
  }
};

// An unsplit item: its rows' o and lse.
template <int D, typename Tr, typename T>
__device__ __forceinline__ void WriteRows(const TileOut<D, Tr, T>& o) {
  constexpr int kM = Tr::kM;
  const int tid = o.tid;
  for (int idx = tid; idx < kM * Tr::kChunks; idx += Tr::kThreads) {
    const int r = idx / Tr::kChunks;
    const int c8 = idx % Tr::kChunks;
        const int64_t row = o.Row(r);
    if (row < 0) continue;
    float v[8];
    o.SumWarps(r, c8, v);
    *reinterpret_cast<uint4*>(o.Out() + row * D + c8 * 8) = PackOut<T>(v);
  }
  if (tid < kM) {
        const int64_t row = o.Row(tid);
    if (row >= 0) o.WriteLse(row, o.s_lse[tid]);
  }
}

// Cluster mode (sm_90+; the plan chooses it only there, DecodeMaxCluster).
template <int D, typename Tr, typename T>
__device__ __forceinline__ void MergeCluster(const TileOut<D, Tr, T>& o) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kM = Tr::kM;
  const int tid = o.tid;
  // ---- Cluster mode: each CTA leaves its state of the tile's valid rows
  // (normalized O, base-2 LSE) in its shared memory; after a cluster
  // barrier, CTA `rank` merges float4 columns rank * kThreads + tid,
  // stepping by the cluster's threads, reading all CTAs' states through
  // distributed shared memory; a second barrier keeps every CTA's shared
  // memory alive until the others have read it.
  namespace cg = cooperative_groups;
  float* s_co = reinterpret_cast<float*>(o.smem + Tr::kClusterOOff);  // (M, D)
  float* s_clse = s_co + kM * D;                                     // (M)
  const int valid_rows = o.ValidRows();
  for (int idx = tid; idx < valid_rows * Tr::kChunks; idx += Tr::kThreads) {
    const int r = idx / Tr::kChunks;
    const int c8 = idx % Tr::kChunks;
    float v[8];
    o.SumWarps(r, c8, v);
    float4* dst = reinterpret_cast<float4*>(s_co + r * D + c8 * 8);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
  if (tid < valid_rows) s_clse[tid] = o.s_lse[tid];
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int nc = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  constexpr int kRowQuads = D / 4;
  const int quads = valid_rows * kRowQuads;
  for (int q = rank * Tr::kThreads + tid; q < quads; q += nc * Tr::kThreads) {
    const int r = q / kRowQuads;
    float lse_c[kMaxDecodeCluster];
    float4 o_c[kMaxDecodeCluster];
    float m = -INFINITY;
#pragma unroll
    for (int c = 0; c < kMaxDecodeCluster; ++c) {
      if (c < nc) {
        lse_c[c] = *cluster.map_shared_rank(s_clse + r, c);
        o_c[c] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(s_co + q * 4, c));
        m = fmaxf(m, lse_c[c]);
      }
    }
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int c = 0; c < kMaxDecodeCluster; ++c) {
      if (c < nc && lse_c[c] != -INFINITY) {
        const float w = Exp2(lse_c[c] - m);
        l += w;
        acc.x += w * o_c[c].x; acc.y += w * o_c[c].y; acc.z += w * o_c[c].z; acc.w += w * o_c[c].w;
      }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
        const int64_t row = o.Row(r);
    if (row < 0) continue;
    *reinterpret_cast<uint2*>(o.Out() + row * D + (q % kRowQuads) * 4) =
        make_uint2(Pack2<T>(acc.x * inv, acc.y * inv), Pack2<T>(acc.z * inv, acc.w * inv));
    if (q % kRowQuads == 0) o.WriteLse(row, l > 0.f ? m + log2f(l) : -INFINITY);
  }
  cluster.sync();
#else
  __trap();
#endif
}

// A split chunk: its partial.
template <int D, typename Tr, typename T>
__device__ __forceinline__ void WritePartial(const TileOut<D, Tr, T>& o) {
  constexpr int kM = Tr::kM;
  const int tid = o.tid;
  const DecodeKernelArgs& args = o.args;
  const DecodeWorkItem& item = o.item;
  // ---- Split chunk: fp32 partial (o, base-2 lse) of the tile's rows that
  // hold a query row (the first valid_rows; the rest is padding, neither
  // written nor merged) into its slot.
  const int valid_rows = o.ValidRows();
  const int64_t slot = static_cast<int64_t>(item.part_begin) + item.chunk;
  for (int idx = tid; idx < valid_rows * Tr::kChunks; idx += Tr::kThreads) {
    const int r = idx / Tr::kChunks;
    const int c8 = idx % Tr::kChunks;
    float v[8];
    o.SumWarps(r, c8, v);
    float4* dst = reinterpret_cast<float4*>(args.part_o + (slot * kM + r) * D + c8 * 8);
    __stcg(dst, make_float4(v[0], v[1], v[2], v[3]));
    __stcg(dst + 1, make_float4(v[4], v[5], v[6], v[7]));
  }
  if (tid < valid_rows) __stcg(args.part_lse + slot * kM + tid, o.s_lse[tid]);
}

// Counts the split chunk done on its tile's counter; whether it was the
// tile's last (which then merges).
template <int D, typename Tr, typename T>
__device__ __forceinline__ bool LastChunk(const TileOut<D, Tr, T>& o) {
  __threadfence();
  __syncthreads();
  if (o.tid == 0) {
    const int done = atomicAdd(o.args.counters + o.item.split_tile, 1);
    *o.s_last = done == o.item.num_chunks - 1;
  }
  __syncthreads();
  if (!*o.s_last) return false;
  __threadfence();
  return true;
}

template <int D, typename Tr, typename T>
__device__ __forceinline__ void MergePartials(const TileOut<D, Tr, T>& o) {
  constexpr int kM = Tr::kM;
  const int tid = o.tid, warp = o.warp, lane = o.lane;
  const DecodeKernelArgs& args = o.args;
  const DecodeWorkItem& item = o.item;
  uint8_t* const smem = o.smem;
  float* const s_row_m = o.s_row_m;
  const int valid_rows = o.ValidRows();
  // ---- Last chunk of the tile: merge the num_chunks partials with every
  // thread. The partials' valid rows stream into shared memory by cp.async
  // (a pass holds kMergePassBytes; most tiles need one pass) while the
  // (chunk, row) LSEs load beside them; one warp per row turns the LSEs into
  // normalized weights; then each thread sums its float4 columns over the
  // pass's chunks. The chain after the counter is about two L2 round trips.
  const int nc = item.num_chunks;
  const int64_t base = item.part_begin;
  float* s_w = reinterpret_cast<float*>(smem);  // (chunks, M): lse, then weight
  const uint32_t a_part = mma::SmemAddr(smem + Tr::kMergeBytes);
  const float* s_part = reinterpret_cast<const float*>(smem + Tr::kMergeBytes);
  constexpr int kRowQuads = D / 4;  // float4s per row
  const int quads = valid_rows * kRowQuads;  // float4s per chunk
  const int pass_chunks = max(1, min(nc, Tr::kMergePassBytes / (quads * 16)));
  auto issue_pass = [&](int c0) {
    const int n = min(pass_chunks, nc - c0);
    for (int idx = tid; idx < n * quads; idx += Tr::kThreads) {
      const int c = idx / quads;
      const int q = idx - c * quads;
      mma::CpAsync16(a_part + idx * 16, args.part_o + ((base + c0 + c) * kM) * D + q * 4, true);
    }
    mma::CpAsyncCommit();
  };
  issue_pass(0);
  for (int idx = tid; idx < nc * valid_rows; idx += Tr::kThreads) {
    const int c = idx / valid_rows;
    const int r = idx - c * valid_rows;
    s_w[c * kM + r] = __ldcg(args.part_lse + (base + c) * kM + r);
  }
  __syncthreads();
  for (int r = warp; r < valid_rows; r += Tr::kWarps) {
    float m = -INFINITY;
    for (int c = lane; c < nc; c += 32) m = fmaxf(m, s_w[c * kM + r]);
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
    float l = 0.f;
    for (int c = lane; c < nc; c += 32) {
      const float x = s_w[c * kM + r];
      const float w = x == -INFINITY ? 0.f : Exp2(x - m);
      s_w[c * kM + r] = w;
      l += w;
    }
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) l += __shfl_xor_sync(0xffffffffu, l, x);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int c = lane; c < nc; c += 32) s_w[c * kM + r] *= inv;
    if (lane == 0) s_row_m[r] = l > 0.f ? m + log2f(l) : -INFINITY;
  }
  // Thread owns float4 columns q = tid + j * kThreads (j < kCols) of the
  // valid rows.
  constexpr int kCols = kM * kRowQuads / Tr::kThreads;  // 2, 4 or 8
  static_assert(kCols * Tr::kThreads == kM * kRowQuads, "merge column split");
  float4 acc[kCols];
#pragma unroll
  for (int j = 0; j < kCols; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int c0 = 0; c0 < nc; c0 += pass_chunks) {
    mma::CpAsyncWait<0>();
    __syncthreads();  // the pass (and, first time, the weights) visible to all
    const int n = min(pass_chunks, nc - c0);
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int q = tid + j * Tr::kThreads;
      if (q >= quads) continue;
      const int r = q / kRowQuads;
      for (int c = 0; c < n; ++c) {
        const float w = s_w[(c0 + c) * kM + r];
        const float4 a = *reinterpret_cast<const float4*>(s_part + (c * quads + q) * 4);
        acc[j].x += w * a.x; acc[j].y += w * a.y; acc[j].z += w * a.z; acc[j].w += w * a.w;
      }
    }
    if (c0 + pass_chunks < nc) {
      __syncthreads();  // everyone is done with the pass before it is refilled
      issue_pass(c0 + pass_chunks);
    }
  }
#pragma unroll
  for (int j = 0; j < kCols; ++j) {
    const int q = tid + j * Tr::kThreads;
    if (q >= quads) continue;
        const int64_t row = o.Row(q / kRowQuads);
    if (row < 0) continue;
    *reinterpret_cast<uint2*>(o.Out() + row * D + (q % kRowQuads) * 4) =
        make_uint2(Pack2<T>(acc[j].x, acc[j].y), Pack2<T>(acc[j].z, acc[j].w));
  }
  if (tid < valid_rows) {
        const int64_t row = o.Row(tid);
    if (row >= 0) o.WriteLse(row, s_row_m[tid]);
  }
  if (tid == 0) args.counters[item.split_tile] = 0;  // ready for the next launch
}

}  // namespace decode
}  // namespace attnserve
