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
};

constexpr int ConstMax(int a, int b) { return a > b ? a : b; }

// F8: the pools are FP8 (a smaller ring: see kStages8).
template <int D, int MT, bool F8 = false>
struct DecodeTraits {
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
  // in flight per SM of the 16-bit ring, over 12 warps instead of 8).
  static constexpr int kChunks8 = D / 16;
  static constexpr int kRowsPerPass8 = 32 / kChunks8;
  static constexpr int kPasses8 = kTok / kRowsPerPass8;
  static constexpr int kStageBytes8 = kTok * D;
  static constexpr int kStages8 = D == 64 ? 8 : 4;
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
__device__ __forceinline__ uint32_t SwzK8(int r, int c) {
  const int x = D == 64 ? 0 : D == 128 ? (r & 1) : ((r & 1) | ((c >> 2) & 2));
  return r * D + ((c ^ x) << 4);
}
template <int D>
__device__ __forceinline__ uint32_t SwzV8(int r, int c) {
  const int x = D == 64 ? 0 : D == 128 ? (((r >> 1) & 3) << 1) : (((r >> 1) & 1) | (((r >> 2) & 1) << 2));
  return r * D + ((c ^ x) << 4);
}

// Four FP8 values (bytes of w) as two pairs of T, exactly: lo holds bytes 0
// and 1 (byte 0 in the low half), hi bytes 2 and 3. Each byte becomes the
// high byte of a 16-bit half; its exponent and mantissa move into T's
// fields, which leaves the value times 2^-(difference of the biases), a
// multiplication by that power of two (exact: every FP8 value is a normal
// T) restores it. E5M2 is an fp16's high byte as it is. NaN bytes (only
// from NaN rows) read as finite values here.
template <int F8, typename T>
__device__ __forceinline__ uint32_t Fp8HalvesToT(uint32_t t) {
  constexpr bool kHalf = std::is_same<T, __half>::value;
  if (F8 == static_cast<int>(Fp8Format::kE5m2) && kHalf) return t;
  constexpr bool kE4m3 = F8 == static_cast<int>(Fp8Format::kE4m3);
  constexpr int kShift = kHalf ? 1 : kE4m3 ? 4 : 3;
  constexpr uint32_t kMask = kHalf ? 0x3f803f80u : kE4m3 ? 0x07f007f0u : 0x0fe00fe0u;
  const uint32_t bits = ((t >> kShift) & kMask) | (t & 0x80008000u);
  uint32_t out;
  if (kHalf) {  // x 2^8
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(bits), "r"(0x5c005c00u));
  } else {  // x 2^120 (E4M3) or 2^112 (E5M2), as an fma with -0
    constexpr uint32_t kPow = kE4m3 ? 0x7b807b80u : 0x77807780u;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(bits), "r"(kPow), "r"(0x80008000u));
  }
  return out;
}
template <int F8, typename T>
__device__ __forceinline__ void Fp8x4ToT(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = Fp8HalvesToT<F8, T>(__byte_perm(w, 0u, 0x1404));
  hi = Fp8HalvesToT<F8, T>(__byte_perm(w, 0u, 0x3424));
}

// The same as fp16 pairs (exact), by the hardware's conversion on sm_89+
// for E4M3 (one instruction a pair; NaN stays NaN).
template <int F8>
__device__ __forceinline__ void Fp8x4ToHalf(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (F8 == static_cast<int>(Fp8Format::kE4m3)) {
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
    lo = uint32_t{a.x} | (uint32_t{a.y} << 16);
    hi = uint32_t{b.x} | (uint32_t{b.y} << 16);
    return;
  }
#endif
  Fp8x4ToT<F8, __half>(w, lo, hi);
}

// bf16 queries over an FP8 pool are multiplied by 2^e and stored as fp16,
// so that S = Q K^T runs in fp16 with K in the hardware's conversion; e is
// chosen per query row (and head) and the row's logit scale takes 2^-e
// back. amax is the row's largest finite |q|; e puts it in [2^14, 2^15):
// then every element of at least 2^-28 amax converts exactly (fp16's 11
// significant bits hold bf16's 8) and a smaller one rounds to fp16's
// subnormal grid with an error below 2^-39 amax. e is clamped to +-100 (2^-e
// times the logit scale stays a normal float), so rows whose largest |q| is
// 2^116 or more overflow fp16; zero amax gives e = 0; a NaN or an infinity
// stays one.
__device__ __forceinline__ float FiniteAbs(float x) { return fabsf(x) <= 3.4028235e38f ? fabsf(x) : 0.f; }
__device__ __forceinline__ int QHalfExponent(float amax) {
  if (!(amax > 0.f) || !(amax <= 3.0e38f)) return 0;
  return max(-100, min(100, 14 - ilogbf(amax)));
}

template <typename T>
__device__ __forceinline__ uint4 PackOut(const float (&v)[8]) {
  return make_uint4(Pack2<T>(v[0], v[1]), Pack2<T>(v[2], v[3]), Pack2<T>(v[4], v[5]),
                    Pack2<T>(v[6], v[7]));
}

}  // namespace decode
}  // namespace attnserve
