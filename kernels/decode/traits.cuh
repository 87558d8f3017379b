// The decode family's kernel arguments, shapes and shared-memory layout, and
// the small device helpers its kernel is built from
// (kernels/decode/decode_kernel.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "common/kv_geometry.h"
#include "kernels/fast_div.h"
#include "kernels/fp8_device.cuh"
#include "kernels/numerics.cuh"
#include "kernels/paged_prefill.h"
#include "kernels/plan/decode_plan.h"
#include "kernels/sm80/mma.cuh"

namespace attnserve {
namespace decode {

struct DecodeKernelArgs {
  PagedPrefillParams p;         // the batch: q, o, lse, caches, indices, sinks, geometry
  const DecodeWorkItem* items;  // each carries its sequence (seq_info)
  float* part_o;              // (slots * M, D) fp32
  float* part_lse;            // (slots * M) base 2
  int32_t* counters;          // (split tiles)
  int32_t skip_merge;
  int32_t cluster;  // > 1: cluster mode (grid = tiles x cluster, sm_90)
  int64_t slots_per_layer;    // p.geo.SlotsPerLayer()
  FastDiv page;               // p.geo.page_size, as a divider of key positions
  // Benchmark only (DecodeLaunchOptions::trace): per CTA, kDecodeTraceWords
  // words (DecodeTraceStamp, decode_cuda.h); null in the server.
  unsigned long long* trace;
};


constexpr int ConstMax(int a, int b) { return a > b ? a : b; }

// Whether a configuration has the family's four-CTA (wide) kernel beside
// its three-CTA one: FP8 pools at head_dim 128 with one m-tile
// (decode_cuda.cu, DecodeWideCtasPerSm).
constexpr bool DecodeHasWideKernel(int D, int MT, bool F8) { return F8 && D == 128 && MT == 1; }

// F8: the pools are FP8 (a smaller ring: see kStages8). kFour: the wide
// kernel (DecodeHasWideKernel), compiled for four CTAs an SM
// (DecodeMinBlocks) instead of three, with one ring stage fewer.
template <int D, int MT, bool F8 = false, bool kFour = false>
struct DecodeTraits {
  static_assert(!kFour || DecodeHasWideKernel(D, MT, F8), "four CTAs an SM: FP8, head_dim 128, one m-tile");
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kM = 16 * MT;             // packed rows per tile
  static constexpr int kTok = 16;                // KV tokens per warp step
  static constexpr int kChunks = D / 8;          // 16-byte chunks per row
  static constexpr int kRowBytes = D * 2;
  // Ring depth per warp: about 96 KiB of K/V per CTA (two CTAs per SM) for
  // head_dim 64 / 128; 128 KiB (one CTA per SM) for 256.
  static constexpr int kStages = D == 64 ? 6 : D == 128 ? 3 : 2;
  static constexpr int kStageBytes = kTok * kRowBytes;  // K (or V) of a step
  // FP8 pools: rows of D bytes; 8 / 4 / 4 stages for head_dim 64 / 128 /
  // 256, so that three CTAs fit an SM at head_dim 64 and 128 (about the bytes
  // in flight per SM of the 16-bit ring, over 12 warps instead of 8); kFour:
  // 3 stages, four CTAs an SM (the same bytes in flight over 16 warps).
  static constexpr int kChunks8 = D / 16;
  static constexpr int kRowsPerPass8 = 32 / kChunks8;
  static constexpr int kPasses8 = kTok / kRowsPerPass8;
  static constexpr int kStageBytes8 = kTok * D;
  static constexpr int kStages8 = D == 64 ? 8 : kFour ? 3 : 4;
  // Steps (of kTok tokens) a warp's main-loop iteration takes: two for the
  // three-CTA FP8 kernel at head_dim 128 with one m-tile (two independent
  // S = Q K^T chains and one softmax reduction a pair: it is bound by its
  // warps' dependent latency, not by memory; while a pair computes, the two
  // steps after it are in flight), else one.
  static constexpr int kStepsPerIter = DecodeStepsPerIter(D, kM, F8, kFour);
  static constexpr int kWarpRingBytes = F8 ? kStages8 * 2 * kStageBytes8 : kStages * 2 * kStageBytes;
  static constexpr int kQBytes = kM * kRowBytes;
  static constexpr int kLoopBytes = kQBytes + kWarps * kWarpRingBytes;
  // Epilogue: each warp's scaled O, fp32, rows padded against bank conflicts.
  static constexpr int kOStride = D + 4;
  static constexpr int kCombineBytes = kWarps * kM * kOStride * 4;
  // Merge: weight of each chunk for each row, then a pass of partials (the
  // rest of the main region).
  static constexpr int kMergeBytes = kMaxDecodeChunks * kM * 4;
  // At least the warps' O plus the cluster state, and the merge's weights
  // plus one pass (the 16-bit ring always holds both; the FP8 one may not).
  static constexpr int kClusterNeed = kCombineBytes + kM * D * 4 + kM * 4;
  static constexpr int kMergeNeed = kMergeBytes + kM * D * 4;
  static constexpr int kMainBytes =
      ConstMax(ConstMax(kLoopBytes, kCombineBytes), ConstMax(kClusterNeed, kMergeNeed));
  // Then: m and l per (warp, row), row max and row sum, the last-CTA flag.
  static constexpr int kSmemBytes = kMainBytes + (2 * kWarps * kM + 2 * kM) * 4 + 16;
  static constexpr int kMergePassBytes = kMainBytes - kMergeBytes;
  // Cluster mode: the CTA's merged O (M, D) fp32 and base-2 LSE (M) after
  // the warps' O, for the other CTAs of the cluster to read.
  static constexpr int kClusterOOff = kCombineBytes;
  static_assert(kClusterOOff + kM * D * 4 + kM * 4 <= kMainBytes && kClusterOOff % 16 == 0, "cluster state");
  static_assert(kMergePassBytes >= kM * D * 4 && kMergeBytes % 16 == 0, "a merge pass holds one chunk");
  static constexpr int kRowsPerPass = 32 / kChunks;
  static constexpr int kPasses = kTok / kRowsPerPass;
  static_assert(kChunks >= 8 && 32 % kChunks == 0, "head_dim 64, 128 or 256");
};

// FP8 pools (docs/design.md section 3, "FP8 KV cache"): byte offset of
// 16-byte chunk c of row r in a K (SwzK8) or V (SwzV8) stage of D-byte rows,
// XOR-swizzled so that the fragment loads of PagedDecodeKernel's FP8 path
// (K: thread (g, c) reads bytes c * D/4 .. of rows g and g + 8; V: bytes
// g * D/8 .. of rows 2c, 2c + 1, 2c + 8, 2c + 9) hit distinct banks
// (head_dim 64's V loads keep a 2-way conflict: a row is 64 bytes).
template <int D>
__host__ __device__ __forceinline__ constexpr uint32_t SwzK8(int r, int c) {
  const int x = D == 64 ? 0 : D == 128 ? (r & 1) : ((r & 1) | ((c >> 2) & 2));
  return r * D + ((c ^ x) << 4);
}
template <int D>
__host__ __device__ __forceinline__ constexpr uint32_t SwzV8(int r, int c) {
  const int x = D == 64 ? 0 : D == 128 ? (((r >> 1) & 3) << 1) : (((r >> 1) & 1) | (((r >> 2) & 1) << 2));
  return r * D + ((c ^ x) << 4);
}

// The copies' passes (PagedDecodeKernel's issue): pass p of a step copies
// rows p * rows_per_pass + r0 of a 16-row stage. SwzRepeats: whether
// swz(r + period * rows_per_pass, c) == swz(r, c) + period * rows_per_pass *
// row_bytes for every row r of the stage and chunk c, so that a lane's
// offsets in every pass are those of the first `period` passes plus whole
// rows. SwzPeriod: the smallest such power of two for all of swzs (it ends:
// once period * rows_per_pass reaches 16, every pass has offsets of its own).
template <typename Swz>
constexpr bool SwzRepeats(Swz swz, int period, int rows_per_pass, int row_bytes, int chunks) {
  const int shift = period * rows_per_pass;
  for (int r = 0; r + shift < 16; ++r) {
    for (int c = 0; c < chunks; ++c) {
      if (swz(r + shift, c) != swz(r, c) + static_cast<uint32_t>(shift * row_bytes)) return false;
    }
  }
  return true;
}
template <typename... Swz>
constexpr int SwzPeriod(int rows_per_pass, int row_bytes, int chunks, Swz... swzs) {
  int period = 1;
  while (!(SwzRepeats(swzs, period, rows_per_pass, row_bytes, chunks) && ...)) period *= 2;
  return period;
}

// FP8 -> 16-bit conversions and QHalfExponent: kernels/fp8_device.cuh.

template <typename T>
__device__ __forceinline__ uint4 PackOut(const float (&v)[8]) {
  return make_uint4(Pack2<T>(v[0], v[1]), Pack2<T>(v[2], v[3]), Pack2<T>(v[4], v[5]),
                    Pack2<T>(v[6], v[7]));
}

}  // namespace decode
}  // namespace attnserve
