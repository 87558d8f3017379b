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

template <int D, int MT, int KB>
struct Traits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kM = kWarps * 16 * MT;     // packed rows per tile
  static constexpr int kChunks = D / 8;            // 16-byte chunks per row
  static constexpr int kRowBytes = D * 2;
  static constexpr int kQBytes = kM * kRowBytes;
  static constexpr int kKvBytes = KB * kRowBytes;  // one stage of K (or V)
  static constexpr int kOffBytes = 2 * KB * 8;      // row offsets, 2 blocks
  static constexpr int kSmemBytes = kQBytes + 4 * kKvBytes + kOffBytes;
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kKvPasses = KB / kRowsPerPass;
  static constexpr int kQPasses = kM / kRowsPerPass;
  // Q fragments stay in registers when they fit beside O and S.
  static constexpr bool kQInRegs = (MT == 1 && D <= 128);
  static_assert(KB % kRowsPerPass == 0 && kM % kRowsPerPass == 0, "tiling");
};

}  // namespace sm80
}  // namespace attnserve
