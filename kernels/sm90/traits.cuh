// The Hopper prefill family's shapes and shared-memory layout
// (kernels/sm90/prefill_kernel.cuh).
#pragma once

#include <cuda.h>  // CUtensorMap (a type only)

#include <cstdint>

#include "kernels/fast_div.h"
#include "kernels/paged_prefill.h"
#include "kernels/plan/prefill_plan.h"
#include "kernels/sm90/prefill_sm90.h"

namespace attnserve {
namespace sm90 {

// Largest growth (base 2) of a row's running max that leaves O unrescaled.
constexpr float kLazyRescale = 8.f;
// Soft-capped bf16 rows whose cap c log2(e) is at most this run at a fixed
// maximum of c log2(e) - kLazyRescale instead of a running one (no row
// maxima): their exponents then span at most 2 * 55 - 8 = 102 below
// kLazyRescale, so the best key of any row keeps 24 bits of fp32's range
// above the flush to 0 (c <= 38.1; Gemma 2's c = 50 takes the running max).
constexpr float kFixedCapMaxBound = 55.f;

struct PrefillKernelArgs {
  PagedPrefillParams p;     // the batch: q, o, lse, caches, indices, seqs, sinks, geometry
  const PrefillWorkItem* items;
  int32_t num_items;        // entries of items (padding included)
  float* part_o;            // (pairs, D) fp32
  float* part_lse;          // (pairs) base 2
  long long* trace;         // PagedPrefillSm90Traced only (Sm90Trace)
  int32_t trace_ctas;
  // Traits::kTma: tensor maps of the K and V caches viewed as (head_dim, KV
  // heads, slots of every layer), 128-byte swizzled boxes of 64 elements x 1
  // head x tma_run rows; tma_run (a power of two >= 8 that divides
  // page_size) is 0 when K and V are gathered by cp.async alone.
  CUtensorMap k_map, v_map;
  int32_t tma_run;
  // Query heads per KV head and the page size, as dividers of packed rows
  // and KV positions (both below 2^31).
  FastDiv group;
  FastDiv page;
  int64_t slots_per_layer;
};

// How the two consumer warpgroups schedule their GEMMs (a compile-time
// option of Traits; PagedPrefillSm90 picks one per launch).
//  - kSerial: per KV block b, S_b = Q K_b^T, wait, mask + softmax, P_b V_b,
//    wait; the warpgroups take turns issuing S (ping-pong on named
//    barriers). PrefillKernel::kSm90.
//  - kOverlap: software-pipelined inside the warpgroup (as FlashAttention-3's
//    intra-warpgroup overlap): turn t issues S_t and P_{t-1} V_{t-1}
//    together, then runs softmax(S_t) while P_{t-1} V_{t-1} is on the tensor
//    cores; optionally the two warpgroups take turns over both GEMMs (the
//    turn covers the S_t and PV_{t-1} issue, so one warpgroup's softmax runs
//    beside the other's GEMMs). PrefillKernel::kSm90Overlap (ping-pong) and
//    kSm90OverlapNoPp (none).
enum class Schedule : int { kSerial, kOverlap };

// One CTA = 3 warpgroups: warpgroup 0 loads (cp.async into rings of
// kKStages K and kVStages V blocks), warpgroups 1 and 2 each compute 64
// packed query rows of the 128-row tile.
// kTmaLoads (kOverlap only): the producer loads whole K and V blocks whose
// rows come in runs of 8 or more slots (page_size >= 8) with the tensor copy
// engine, a box per run, instead of cp.async; the stages' full barriers then
// also count the boxes' bytes.
// kSoftCaps, kSinkSets: the kernel runs soft-capped sequences, sinks
// (kernels/variant.h); without, their code is left out (the soft-cap's pass
// costs the head_dim 128 consumers registers, and a few bytes of spill). The
// launch picks the leanest kernel the batch allows
// (PagedPrefillParams::any_soft_cap, sinks).
// kFp8Kv (kOverlap only): the caches hold FP8 bytes (PagedPrefillParams,
// geo.kv_fp8). The producer lands each K or V block's bytes in the upper
// half of its stage (tensor copies of whole rows, or cp.async), waits for
// them on the stage's land barrier, and rewrites the stage in place as fp16
// (exact for both formats) before it completes the full barrier; both GEMMs
// then run in fp16. bf16 queries become fp16 times a power of two per row
// (the decode family's QHalfExponent), converted in place by each consumer
// warpgroup, its own rows, once the tile lands (the rows' exponents beside
// the tile, kQExpOff); K's scale joins the logit scale, V's the output's.
// kFp8Queries (kFp8Kv, head_dim 128; PrefillKernel::kSm90Fp8Q, opt-in): S =
// Q K^T runs in FP8 on the stored K bytes, whose format it names (E4M3 or
// E5M2 as the B operand; kNone: the queries stay in 16 bits). Each consumer
// warpgroup rounds its rows of the landed Q tile to E4M3 times a power of two
// per row (QRowsToFp8, QFp8Exponent in kernels/fp8.h), into the tile's first
// column block, as the 128-byte swizzled 128 x 128-byte operand the FP8
// wgmma reads; K blocks are not converted (the consumers wait for their land
// barriers and fence), so the converters rewrite V blocks alone. P V stays
// in fp16. The queries' rounding is this kernel's own error
// (docs/design.md section 3, "FP8 KV cache").
template <int D, Schedule kSchedule = Schedule::kSerial, bool kTurns = true, bool kTmaLoads = false,
          bool kSoftCaps = true, bool kSinkSets = true, bool kFp8Kv = false,
          Fp8Format kFp8Queries = Fp8Format::kNone>
struct Traits {
  static_assert(D == 64 || D == 128, "the sm90 family runs head_dim 64 and 128");
  static constexpr int kD = D;
  static constexpr int kM = 128;            // packed rows per tile
  static constexpr int kWgRows = 64;        // rows per consumer warpgroup
  static constexpr int kKB = 128;           // KV tokens per block
  static constexpr bool kOverlap = kSchedule == Schedule::kOverlap;
  static constexpr bool kTma = kTmaLoads && kOverlap;
  static constexpr bool kSoftCap = kSoftCaps;
  static constexpr bool kSinks = kSinkSets;
  static constexpr bool kFp8 = kFp8Kv;
  static_assert(!kFp8 || kSchedule == Schedule::kOverlap, "FP8 pools run on the overlapped schedule");
  static constexpr bool kFp8Q = kFp8Queries != Fp8Format::kNone;
  static constexpr bool kFp8QKE5m2 = kFp8Queries == Fp8Format::kE5m2;  // K's bytes are E5M2
  static_assert(!kFp8Q || (kFp8 && D == 128), "FP8 queries: FP8 pools at head_dim 128");
  // FP8 bytes of a block's K (or V) rows: the upper half of the stage.
  static constexpr int kFp8Bytes = 128 * D;
  static constexpr int kFp8At = 128 * D;  // offset within the stage
  // A persistent grid (kOverlap): each CTA loops over the plan's items with
  // a stride of the grid, so that the producer loads the next tile's K, V
  // and Q while the consumers finish the last one; kSerial runs one item
  // per CTA.
  static constexpr bool kPersistent = kOverlap;
  // Q buffers: a persistent CTA loads the next tile's Q while the consumers
  // still read this one's (a load takes longer than the consumers' last
  // turn and epilogue, so one buffer left them waiting at every tile).
  static constexpr int kQBufs = kPersistent ? 2 : 1;
  // Ring stages of K and of V blocks (kSerial: one ring of K and V stages).
  // At head_dim 128 the second Q buffer takes a stage: K has 2 and V 3, so
  // that K_b is issued once S_{b-2} has completed and V_b once
  // P_{b-3} V_{b-3} has, about two turns ahead of their use either way.
  static constexpr int kStages = D == 64 ? 4 : 3;
  static constexpr int kKStages = kOverlap && D == 128 ? 2 : kStages;
  static constexpr int kVStages = kStages;
  // The consumer warpgroups take turns issuing their GEMMs (kSerial: S only;
  // kOverlap: S_t and PV_{t-1}).
  static constexpr bool kPingPong = kTurns;
  // K and V stages are released on separate mbarriers (kOverlap): K_b once
  // S_b has completed, V_b once P_b V_b has. With one barrier per stage the
  // overlapped consumers would release block b only after S_{b+1}, so the
  // producer could refill its K stage one turn later.
  static constexpr bool kSplitEmpty = kOverlap;
  // kSerial: copy groups (one K or V block each) a producer thread keeps in
  // flight before it waits for the oldest. Before it refills a stage, the
  // producer must have completed the V block the consumers release it after
  // (G(2(b - kStages) + 2) by the time it has issued G(2b)): at most
  // 2 * kStages - 2.
  static constexpr int kInFlight = 2 * kStages - 2;
  static_assert(kOverlap || kKStages == kVStages, "the serial schedule has one ring");
  // kOverlap: the producer never waits for its copies. After issuing the
  // K (V) rows of block b each producer thread makes the stage's k_full
  // (v_full) mbarrier track them (cp.async.mbarrier.arrive.noinc; 128
  // arrivals complete the phase), so a block is signalled the moment its
  // last row lands, whatever the producer is doing; the producer blocks only
  // on k_empty(b - kKStages) before K_b and v_empty(b - kVStages) before V_b
  // (and on q_empty of the tile two back before a tile's Q) and so keeps
  // every free stage in flight. The consumers fence to the async proxy after
  // each k_full / v_full wait, before wgmma reads the stage (on FP8 pools
  // the converters fence instead, ConsumerRole's `fences`). No deadlock:
  // k_empty(b - kKStages) needs turn b - kKStages, whose K and
  // V_{b - kKStages - 1} were issued before K_b; v_empty(b - kVStages) needs
  // turn b - kVStages + 1, whose K_{b - kVStages + 1} (kVStages >= 2) and
  // V_{b - kVStages} were issued before V_b; q_empty of tile i - 2 needs only
  // tile i - 2's blocks. (kSerial keeps the waiting producer: kInFlight
  // above.)
  // kFp8: a fourth warpgroup converts each landed FP8 block to fp16
  // (ConverterRole, producer.cuh). The producer converting them itself
  // between its copies was the bound (FP8 at 0.63-0.82 of bf16), and
  // halving either role to make room for the other ran slower still
  // (bench/results/2026-12-03-session20-h200.md). bf16 Q tiles are the
  // consumers' (QRowsToHalf): on the converters, after every block, they
  // were the bound on short tiles (bench/results/2026-12-03-session21-h200.md).
  static constexpr int kConvertThreads = kFp8 ? 128 : 0;
  static constexpr int kThreads = 384 + kConvertThreads;
  // setmaxnreg after the split: the sum (128 x producer + 256 x consumer)
  // must not exceed the 168 x 384 = 64,512 the kernel starts with, or the
  // consumers' increase waits for registers that never come (64 / 224 hung
  // the kernel on the H200). 72 / 216 (64,512, all of it): the consumers
  // fit 216 without spill (ptxas -v; 208 spills), and the producer's 72
  // let a whole block's eight row addresses live at once, so that its
  // cp.async copies issue back to back. At 64 the profile showed each
  // row's address waiting for the copy before it to read its registers;
  // with 72 and the whole-block copies (prefill_kernel.cuh) page_size 1 ran
  // 4-7% faster (bench/results/2026-12-01-session8-h200.md, r30).
  // kFp8: the producer and the converters share what the consumers leave
  // of 128 x 512: 40 each.
  static constexpr int kProducerRegs = kFp8 ? 40 : 72;
  static constexpr int kConverterRegs = 40;
  static constexpr int kConsumerRegs = 216;
  static constexpr int kStartRegs = (65536 / kThreads) & ~7;  // a thread's at launch (168; kFp8 128)
  static_assert(128 * kProducerRegs + kConvertThreads * kConverterRegs + 256 * kConsumerRegs <= kStartRegs * kThreads,
                "register split");
  static constexpr int kChunks = D / 8;     // 16-byte chunks per row
  // Tiles are stored as D / 64 column blocks of (rows x 128 bytes), 128-byte
  // swizzled (TileOff); a column block of R rows spans R * 128 bytes.
  static constexpr int kQBytes = kM * D * 2;
  static constexpr int kKvBytes = kKB * D * 2;  // one stage of K (or V)
  static constexpr int kQOff = 0;
  static constexpr int kKOff = kQOff + kQBufs * kQBytes;
  static constexpr int kVOff = kKOff + kKStages * kKvBytes;
  // Slots (page * page_size + offset within the layer, int32; -1 past the
  // end) of the KV rows of two blocks.
  static constexpr int kSlotOff = kVOff + kVStages * kKvBytes;
  static constexpr int kBarOff = kSlotOff + 2 * kKB * 4;
  // Barriers (indices): q_full[kQBufs], k_full[kKStages], v_full[kVStages],
  // empty[kStages] (kSplitEmpty: k_empty[kKStages], then v_empty[kVStages]),
  // then q_empty[kQBufs] (kPersistent).
  static constexpr int kBarQFull = 0;
  static constexpr int kBarKFull = kBarQFull + kQBufs;
  static constexpr int kBarVFull = kBarKFull + kKStages;
  static constexpr int kBarKEmpty = kBarVFull + kVStages;
  static constexpr int kBarVEmpty = kSplitEmpty ? kBarKEmpty + kKStages : kBarKEmpty;
  static constexpr int kBarQEmpty = kBarVEmpty + kVStages;
  // kFp8: k_land[kKStages], v_land[kVStages] (a block's FP8 bytes have
  // landed).
  static constexpr int kBarKLand = kBarQEmpty + (kPersistent ? kQBufs : 0);
  static constexpr int kBarVLand = kBarKLand + (kFp8 ? kKStages : 0);
  static constexpr int kNumBars = kBarVLand + (kFp8 ? kVStages : 0);
  // One word the overlapped consumers store their row sums to before they
  // wait for P V (OrderBeforeWait in ptx.cuh); never read.
  static constexpr int kSinkOff = kBarOff + kNumBars * 8;
  // kFp8: each Q buffer's rows' exponents (int8, QHalfExponent).
  static constexpr int kQExpOff = kSinkOff + 16;
  // + 1024: the dynamic shared memory base is aligned up to 1024 bytes (the
  // swizzle atom) in the kernel.
  static constexpr int kSmemBytes = kQExpOff + (kFp8 ? kQBufs * kM : 0) + 1024;
  static constexpr int kRowsPerPass = 128 / kChunks;  // Q rows per producer pass
  static constexpr int kQPasses = kM / kRowsPerPass;
  static constexpr int kQUnroll = kFp8 ? 1 : kQPasses;  // Q passes unrolled together (ProducerRole)
  static_assert(kKB == 128, "one producer thread per KV row of a block");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  static_assert((kQBytes % 1024) == 0 && (kKOff % 1024) == 0 && (kVOff % 1024) == 0 && (kKvBytes % 1024) == 0,
                "atoms");
};

// clock64() stamps of a traced CTA (Sm90Trace); no code without kTrace.
template <bool kTrace>
struct Stamps {
  long long* at = nullptr;  // this thread's stamps; null: not stamping
  __device__ __forceinline__ Stamps(const PrefillKernelArgs& args, int offset, bool stamper) {
    if constexpr (kTrace) {
      if (stamper && static_cast<int>(blockIdx.x) < args.trace_ctas) {
        at = args.trace + static_cast<int64_t>(blockIdx.x) * Sm90Trace::kLongsPerCta + offset;
      }
    }
  }
  __device__ __forceinline__ void Put(int i, long long v) {
    if constexpr (kTrace) {
      if (at != nullptr) at[i] = v;
    }
  }
  __device__ __forceinline__ void Now(int i) {
    if constexpr (kTrace) {
      if (at != nullptr) at[i] = clock64();
    }
  }
};

// Byte offset of 16-byte chunk c (0 .. D/8) of row r in a tile of R rows.
template <int R>
__device__ __forceinline__ uint32_t TileOff(int r, int c) {
  return (c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

}  // namespace sm90
}  // namespace attnserve
