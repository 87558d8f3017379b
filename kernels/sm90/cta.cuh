// The sm90 paged prefill kernel's shared pieces (kernels/sm90/
// prefill_kernel.cuh): the work item as a CTA runs it, the loop over a
// CTA's items that both roles walk, and the CTA's shared-memory layout and
// mbarriers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/sm90/ptx.cuh"
#include "kernels/sm90/traits.cuh"
#include "kernels/variant.h"

namespace attnserve {
namespace sm90 {

// One work item as a CTA runs it: the item, its sequence, the KV blocks its
// tile reads and where they sit in the CTA's stage ring.
struct Tile {
  PrefillWorkItem item;
  PrefillSeq seq;
  int kv_end;      // the tile reads [item.kv_begin, kv_end): what its rows see (kernels/variant.h)
  int num_blocks;  // KV blocks of Tr::kKB keys
  int g0;          // ring position of block 0 (K stage g0 % kKStages, V stage g0 % kVStages)
  bool q_ahead;    // Tr::kPersistent: the Q tile is loaded by the previous tile's producer
  int idx;         // the item's index in the plan
  int n;           // the CTA's tiles before this one (padding not counted): its Q phase
  bool first;      // the CTA's first tile (kTrace stamps it)
};

// Item idx's descriptor and KV blocks (not its ring position or phases);
// item.seq < 0 (padding): nothing else is set.
template <typename Tr>
__device__ __forceinline__ Tile MakeTile(const PrefillKernelArgs& args, int idx) {
  Tile t;
  t.item = args.items[idx];
  t.idx = idx;
  if (t.item.seq < 0) return t;
  t.seq = args.p.seqs[t.item.seq];
  const int t_last = min(t.seq.q_len - 1, args.group.Div(t.item.row_begin + Tr::kM - 1));
  t.kv_end = min(t.item.kv_end, RowKeys(t.seq, t_last).end);
  t.num_blocks = t.kv_end > t.item.kv_begin ? (t.kv_end - t.item.kv_begin + Tr::kKB - 1) / Tr::kKB : 0;
  return t;
}

// Brings the line at p into L1.
__device__ __forceinline__ void PrefetchL1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
}

// body(tile, fetch_next) for each item of this CTA: item blockIdx.x, then
// (Tr::kPersistent) every gridDim.x-th after it, skipping padding (seq -1);
// the ring position and Q phase count on across tiles. Producer and
// consumers walk the same items. fetch_next() loads the next item's
// descriptor (two dependent global reads): the body calls it where the
// reads can overlap its own work (the consumers before their epilogue),
// so that the next tile does not start by waiting on them; a body that does
// not call it gets it after it returns.
template <typename Tr, typename Body>
__device__ __forceinline__ void ForEachTile(const PrefillKernelArgs& args, Body&& body) {
  const int step = Tr::kPersistent ? static_cast<int>(gridDim.x) : args.num_items;
  int ring = 0;
  int n = 0;
  bool prev_valid = false;  // item idx - step is not padding
  int idx = blockIdx.x;
  Tile t;
  if (idx < args.num_items) t = MakeTile<Tr>(args, idx);
  for (; idx < args.num_items; idx += step) {
    Tile next;
    bool fetched = false;
    auto fetch_next = [&]() {
      if (!fetched && idx + step < args.num_items) next = MakeTile<Tr>(args, idx + step);
      fetched = true;
    };
    const bool valid = t.item.seq >= 0;
    t.q_ahead = Tr::kPersistent && prev_valid;
    prev_valid = valid;
    if (valid) {
      t.g0 = ring;
      t.first = idx == static_cast<int>(blockIdx.x);
      t.n = n++;
      ring += t.num_blocks;
      body(t, fetch_next);
    }
    fetch_next();
    t = next;
  }
}

// A CTA's shared memory (traits.cuh's layout, aligned to the 1024-byte
// swizzle atom: descriptors assume base offset 0) and its mbarriers, as
// both roles address them.
template <typename Tr>
struct CtaSmem {
  uint8_t* smem;   // the aligned start
  uint32_t base;   // its shared-space address
  uint32_t a_k;    // K stages
  uint32_t a_v;    // V stages
  uint32_t bars;   // the mbarriers
  int32_t* s_slot;  // the producer's page-table lookups, a block ahead
  int8_t* s_qexp;   // Tr::kFp8: each Q buffer's rows' exponents (kQToHalf; 0 otherwise)

  __device__ __forceinline__ static CtaSmem Of(uint8_t* raw) {
    CtaSmem c;
    c.smem = raw + ((1024 - (SmemAddr(raw) & 1023)) & 1023);
    c.base = SmemAddr(c.smem);
    c.a_k = c.base + Tr::kKOff;
    c.a_v = c.base + Tr::kVOff;
    c.bars = c.base + Tr::kBarOff;
    c.s_slot = reinterpret_cast<int32_t*>(c.smem + Tr::kSlotOff);
    c.s_qexp = reinterpret_cast<int8_t*>(c.smem + Tr::kQExpOff);
    return c;
  }
  // Q buffer qb (a tile with Q phase qt uses qt % kQBufs).
  __device__ __forceinline__ uint32_t a_q(int qb) const { return base + Tr::kQOff + qb * Tr::kQBytes; }
  // Completed by the producer (128 arrivals, plus the tensor copies' bytes).
  __device__ __forceinline__ uint32_t bar_q(int qb) const { return bars + 8 * (Tr::kBarQFull + qb); }
  __device__ __forceinline__ uint32_t bar_k(int s) const { return bars + 8 * (Tr::kBarKFull + s); }
  __device__ __forceinline__ uint32_t bar_v(int s) const { return bars + 8 * (Tr::kBarVFull + s); }
  // Released by the consumers (256 arrivals): the stage's K and V buffers
  // (one barrier), or K and V apart (Tr::kSplitEmpty).
  __device__ __forceinline__ uint32_t bar_k_empty(int s) const { return bars + 8 * (Tr::kBarKEmpty + s); }
  __device__ __forceinline__ uint32_t bar_v_empty(int s) const { return bars + 8 * (Tr::kBarVEmpty + s); }
  // Tr::kPersistent: released by the consumers (256 arrivals) once their
  // last S = Q K^T of a tile has completed; the producer then loads the Q
  // of the tile kQBufs after it into the buffer.
  __device__ __forceinline__ uint32_t bar_q_empty(int qb) const { return bars + 8 * (Tr::kBarQEmpty + qb); }
  // Tr::kFp8: a stage's FP8 bytes have landed (128 arrivals, plus the
  // tensor copies' bytes); the converters then rewrite them and complete
  // the full barrier.
  __device__ __forceinline__ uint32_t bar_k_land(int s) const { return bars + 8 * (Tr::kBarKLand + s); }
  __device__ __forceinline__ uint32_t bar_v_land(int s) const { return bars + 8 * (Tr::kBarVLand + s); }
};

// The GEMMs' 16-bit type: on FP8 pools (Tr::kFp8) both run in fp16, and
// bf16 queries are carried into fp16 per row (kQToHalf: each consumer
// warpgroup its own rows of a landed Q tile, QRowsToHalf).
template <typename Tr, typename T>
struct GemmTypes {
  using TC = std::conditional_t<Tr::kFp8, __half, T>;
  static constexpr bool kQToHalf = Tr::kFp8 && !Tr::kFp8Q && std::is_same<T, __nv_bfloat16>::value;
  // The consumers rewrite their rows of each landed Q tile (kQToHalf, or
  // Tr::kFp8Q: QRowsToFp8 for either query type), a negative scale's sign
  // included, and each row's logit multiplier takes the row's power of two
  // back; otherwise the producer flips Q's sign for a negative scale.
  static constexpr bool kConsumersConvertQ = kQToHalf || Tr::kFp8Q;
};

}  // namespace sm90
}  // namespace attnserve
