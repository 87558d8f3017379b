// The sm80 prefill family's shapes and shared-memory layout, and the small
// device helpers its kernel is built from (kernels/sm80/prefill_kernel.cuh).
#pragma once

#include <cstdint>

#include "kernels/numerics.cuh"
#include "kernels/paged_prefill.h"
#include "kernels/plan/prefill_plan.h"

namespace attnserve {
namespace sm80 {

// Largest growth (base 2) of a row's running max that leaves O unrescaled
// (the lazy rescale of the online softmax, prefill_kernel.cuh).
constexpr float kLazyRescale = 8.f;

struct PrefillKernelArgs {
  PagedPrefillParams p;     // the batch: q, o, lse, caches, indices, seqs, sinks, geometry
  const PrefillWorkItem* items;
  float* part_o;            // (pairs, D) fp32
  float* part_lse;          // (pairs) base 2
  int64_t slots_per_layer;  // p.geo.SlotsPerLayer()
};

// kFp8: the caches hold FP8 bytes (PagedPrefillParams, geo.kv_fp8). Each
// block's K and V rows land as they are stored in two raw stages of D bytes
// a row; once a block has landed the CTA rewrites it as the fp16 K and V
// tiles the MMAs read (one stage each: the CTA converts a block just before
// its MMAs), and both MMAs run in fp16 (prefill_kernel.cuh).
template <int D, int MT, int KB, bool kFp8Kv = false>
struct Traits {
  static constexpr bool kFp8 = kFp8Kv;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kM = kWarps * 16 * MT;     // packed rows per tile
  static constexpr int kChunks = D / 8;            // 16-byte chunks per row
  static constexpr int kRowBytes = D * 2;
  static constexpr int kQBytes = kM * kRowBytes;
  static constexpr int kKvBytes = KB * kRowBytes;  // one stage of K (or V)
  static constexpr int kKvStages = kFp8 ? 1 : 2;   // 16-bit stages of K (and of V)
  static constexpr int kRawBytes = KB * D;         // kFp8: one raw stage of K (or V)
  static constexpr int kOffBytes = 2 * KB * 8;      // row offsets, 2 blocks
  static constexpr int kKOff = kQBytes;
  static constexpr int kVOff = kKOff + kKvStages * kKvBytes;
  static constexpr int kRawKOff = kVOff + kKvStages * kKvBytes;  // kFp8: 2 stages
  static constexpr int kRawVOff = kRawKOff + (kFp8 ? 2 * kRawBytes : 0);
  static constexpr int kOffOff = kRawVOff + (kFp8 ? 2 * kRawBytes : 0);
  static constexpr int kQExpOff = kOffOff + kOffBytes;  // kFp8: each Q row's exponent (int32)
  static constexpr int kSmemBytes = kQExpOff + (kFp8 ? kM * 4 : 0);
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kKvPasses = KB / kRowsPerPass;
  static constexpr int kQPasses = kM / kRowsPerPass;
  // kFp8: 16-byte chunks of an FP8 row, rows per copy pass.
  static constexpr int kChunks8 = D / 16;
  static constexpr int kRowsPerPass8 = kThreads / kChunks8;
  static constexpr int kKvPasses8 = KB / kRowsPerPass8;
  // Q fragments stay in registers when they fit beside O and S.
  static constexpr bool kQInRegs = (MT == 1 && D <= 128);
  static_assert(KB % kRowsPerPass == 0 && kM % kRowsPerPass == 0 && KB % kRowsPerPass8 == 0, "tiling");
  static_assert(kFp8 || kSmemBytes == kQBytes + 4 * kKvBytes + kOffBytes, "the 16-bit layout");
};

}  // namespace sm80
}  // namespace attnserve
