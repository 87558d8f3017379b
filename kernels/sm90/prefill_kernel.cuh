// The sm90 paged prefill kernel: wgmma with a warp-specialized producer.
//
// 3 warpgroups per CTA; one work item per CTA (Schedule::kSerial) or, for
// the overlapped schedule, a persistent CTA per SM looping over the plan's
// items (ForEachTile; Traits::kPersistent):
//  - warpgroup 0 (producer, registers lowered by setmaxnreg) gathers the Q
//    tile and K/V blocks of kKB rows with cp.async into rings of kKStages
//    K and kVStages V stages; page_size 1 gathers arbitrary rows, which the
//    tensor copy engine cannot. Each thread owns one KV row's page-table
//    lookup per block,
//    loaded one block ahead, and eight lanes copy each 128-byte line. In the
//    serial schedule a group of copies is complete when cp.async waits for
//    it; the thread then fences to the async proxy and arrives on the
//    stage's mbarrier. In the overlapped one each stage's barrier tracks the
//    copies (cp.async.mbarrier.arrive.noinc; K and V apart, so S = Q K^T
//    starts before V lands) and, with Traits::kTma (pages of 8 rows or
//    more), whole blocks come by the tensor copy engine instead, one
//    128-byte swizzled box per run of rows within a page and column block;
//    the block's bytes complete the stage's barrier.
//  - warpgroups 1 and 2 (consumers, registers raised) each own 64 packed
//    query rows: S = Q K^T by wgmma with both operands in shared memory
//    (K-major), the boundary mask, the lazy online softmax in base 2, and
//    O += P V by wgmma with P in registers and V in shared memory (MN-major);
//    then they release the stage (empty mbarrier). The two take turns to
//    issue S (ping-pong, named barriers) so one's softmax overlaps the other's
//    GEMMs. Traits::kOverlap (PagedPrefillSm90OverlapKernel) pipelines each
//    warpgroup instead: turn t issues S_t and P_{t-1} V_{t-1}, then computes
//    softmax(S_t) while P_{t-1} V_{t-1} runs (traits.cuh, Schedule). Q has
//    two buffers there: the producer loads the next tile's Q as it starts a
//    tile (a Q load takes longer than a tile's last turn and epilogue), and
//    the consumers release a buffer (q_empty) after their last S of its
//    tile. Their turns run on across tiles, so that warpgroup 0 starts the
//    next tile while warpgroup 1 finishes this one.
// Per-tile index arithmetic divides by launch constants (FastDiv), and each
// tile's descriptor is read while the last one's epilogue runs.
// The epilogue normalises and writes either the final o / lse (16-byte
// chunks after a transpose within each quad) or, for a split item, an fp32
// partial state for the merge family, as kernels/sm80.
// Traits::kFp8 (PagedPrefillSm90OverlapKernel's kFp8, kernels/sm90/
// prefill_fp8.cu): on FP8 pools the producer lands each block's FP8 rows in
// the upper half of its stage and converts the stage in place to fp16
// (kernels/sm90/fp8_tiles.cuh) before it completes the full barrier; bf16 Q
// tiles are carried into fp16 per row; both GEMMs run in fp16.
// kTrace (PagedPrefillSm90Traced) adds clock64 stamps of each phase
// (Sm90Trace); the server's kernels have none.
//
// Semantics are those of kernels/paged_prefill.h, written once in
// kernels/variant.h (GQA packing, causal with causal_shift, windows,
// soft-cap, sinks, empty rows -> 0 and -inf or the sink, base-2 LSE).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/fp8_device.cuh"
#include "kernels/math.h"
#include "kernels/sm90/fp8_tiles.cuh"
#include "kernels/sm90/ptx.cuh"
#include "kernels/sm90/traits.cuh"
#include "kernels/variant.h"

namespace attnserve {
namespace sm90 {

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNSERVE_SM90_DEVICE 1
#else
#define ATTNSERVE_SM90_DEVICE 0
#endif

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

// Transposes the 4 x 4 matrix of words whose row j lane j of a quad (4
// consecutive lanes, j = lane % 4) holds in w: afterwards w[i] of lane j is
// the old w[j] of lane i. Two butterfly stages of two shuffles each (every
// lane of the warp takes part).
__device__ __forceinline__ void QuadTranspose(uint32_t (&w)[4], int j) {
  // Selects, not w[j-dependent index]: the array stays in registers.
  // Within 2 x 2 blocks: lane j swaps its word of the column whose parity
  // differs from its own with lane j ^ 1's.
  const bool odd = (j & 1) != 0;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w[2 * q] : w[2 * q + 1], 1);
    w[2 * q] = odd ? got : w[2 * q];
    w[2 * q + 1] = odd ? w[2 * q + 1] : got;
  }
  // The off-diagonal 2 x 2 blocks: with lane j ^ 2.
  const bool high = (j & 2) != 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? w[r] : w[r + 2], 2);
    w[r] = high ? got : w[r];
    w[r + 2] = high ? w[r + 2] : got;
  }
}

// One CTA's work items (the body of both kernels below; sm_90a only).
template <typename Tr, typename T, bool kTrace = false>
__device__ __forceinline__ void PrefillCta(const PrefillKernelArgs& args) {
  constexpr int D = Tr::kD;
  constexpr int KB = Tr::kKB;
  constexpr int SK = Tr::kKStages;
  constexpr int SV = Tr::kVStages;
  constexpr int QB = Tr::kQBufs;
  // FP8 pools (Tr::kFp8): both GEMMs in fp16; bf16 queries are carried
  // into it per row (kQToHalf).
  using TC = std::conditional_t<Tr::kFp8, __half, T>;
  constexpr bool kQToHalf = Tr::kFp8 && std::is_same<T, __nv_bfloat16>::value;
  extern __shared__ uint8_t smem_raw[];
  // Align to the 1024-byte swizzle atom (descriptors assume base offset 0).
  const uint32_t raw_addr = SmemAddr(smem_raw);
  uint8_t* smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  const uint32_t base = SmemAddr(smem);
  // Q buffer qb (a tile with Q phase qt uses qt % QB), K and V stages.
  auto a_q = [&](int qb) { return base + Tr::kQOff + qb * Tr::kQBytes; };
  const uint32_t a_k = base + Tr::kKOff;
  const uint32_t a_v = base + Tr::kVOff;
  int32_t* s_slot = reinterpret_cast<int32_t*>(smem + Tr::kSlotOff);
  const uint32_t bars = base + Tr::kBarOff;
  // Completed by the producer (128 arrivals, plus the tensor copies' bytes).
  auto bar_q = [&](int qb) { return bars + 8 * (Tr::kBarQFull + qb); };
  auto bar_k = [&](int s) { return bars + 8 * (Tr::kBarKFull + s); };
  auto bar_v = [&](int s) { return bars + 8 * (Tr::kBarVFull + s); };
  // Released by the consumers (256 arrivals): the stage's K and V buffers
  // (one barrier), or K and V apart (Tr::kSplitEmpty).
  auto bar_k_empty = [&](int s) { return bars + 8 * (Tr::kBarKEmpty + s); };
  auto bar_v_empty = [&](int s) { return bars + 8 * (Tr::kBarVEmpty + s); };
  // Tr::kPersistent: released by the consumers (256 arrivals) once their
  // last S = Q K^T of a tile has completed; the producer then loads the
  // Q of the tile QB after it into the buffer.
  auto bar_q_empty = [&](int qb) { return bars + 8 * (Tr::kBarQEmpty + qb); };
  // Tr::kFp8: a Q buffer's bf16 rows, a stage's FP8 bytes have landed
  // (128 arrivals, plus the tensor copies' bytes); the producer then
  // converts them and completes the full barrier.
  auto bar_q_land = [&](int qb) { return bars + 8 * (Tr::kBarQLand + qb); };
  auto bar_k_land = [&](int s) { return bars + 8 * (Tr::kBarKLand + s); };
  auto bar_v_land = [&](int s) { return bars + 8 * (Tr::kBarVLand + s); };
  // Tr::kFp8: each Q buffer's rows' exponents (kQToHalf; 0 otherwise).
  int8_t* s_qexp = reinterpret_cast<int8_t*>(smem + Tr::kQExpOff);

  const int tid = threadIdx.x;
  const int wg = tid >> 7;  // 0 producer, 1..2 consumers

  if (tid == 0) {
    for (int qb = 0; qb < QB; ++qb) {
      MbarInit(bar_q(qb), 128);
      if (Tr::kPersistent) MbarInit(bar_q_empty(qb), 256);
    }
    for (int s = 0; s < SK; ++s) {
      MbarInit(bar_k(s), 128);
      MbarInit(bar_k_empty(s), 256);
    }
    for (int s = 0; s < SV; ++s) {
      MbarInit(bar_v(s), 128);
      if (Tr::kSplitEmpty) MbarInit(bar_v_empty(s), 256);
    }
    if constexpr (Tr::kFp8) {
      for (int qb = 0; qb < QB; ++qb) MbarInit(bar_q_land(qb), 128);
      for (int s = 0; s < SK; ++s) MbarInit(bar_k_land(s), 128);
      for (int s = 0; s < SV; ++s) MbarInit(bar_v_land(s), 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // setmaxnreg in each role's own branch: ptxas honours it only where it
  // dominates code of that role alone (C7507 otherwise).
  if (wg == 0) {
    RegDealloc<Tr::kProducerRegs>();
    ForEachTile<Tr>(args, [&](const Tile& tile, auto&&) {
      const PrefillWorkItem& item = tile.item;
      const PrefillSeq& seq = tile.seq;
      const int H = args.p.geo.num_qo_heads;
      const int group = args.group.d;
      const int kvh = item.kv_head;
      const int kv_begin = item.kv_begin;
      const int kv_end = tile.kv_end;
      const int num_blocks = tile.num_blocks;
      const int g0 = tile.g0;
      const int qt = tile.n;  // Q phase
      const bool first = tile.first;
      if constexpr (kTrace) {
        Stamps<kTrace> header(args, 0, tid == 0 && first);
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        header.Put(0, smid);
        header.Now(1);
        header.Put(4, num_blocks);
      }
      // ======================= producer =======================
      const int c = tid % Tr::kChunks;
      const int r0 = tid / Tr::kChunks;

      // ---- Q tile of tile qtile into buffer qb: packed row r -> token
      // r / group, head kvh * group + r % group. The thread's rows are
      // r0 + kRowsPerPass * p: one division, then carries.
      auto issue_q = [&](const Tile& qtile, int qb) {
        const T* q = static_cast<const T*>(args.p.q);
        const int pr0 = qtile.item.row_begin + r0;
        int t = args.group.Div(pr0);
        int g = pr0 - t * group;
        const int dt = args.group.Div(Tr::kRowsPerPass);
        const int dg = Tr::kRowsPerPass - dt * group;
        const T* head0 = q + (static_cast<int64_t>(qtile.seq.q_start) * H + qtile.item.kv_head * group) * D + c * 8;
#pragma unroll
        for (int p = 0; p < Tr::kQPasses; ++p) {
          const bool valid = t < qtile.seq.q_len;
          const T* src = valid ? head0 + (static_cast<int64_t>(t) * H + g) * D : q;
          CpAsync16(a_q(qb) + TileOff<Tr::kM>(p * Tr::kRowsPerPass + r0, c), src, valid);
          t += dt;
          g += dg;
          if (g >= group) {
            g -= group;
            ++t;
          }
        }
        CpAsyncCommit();
      };
      // A negative scale is moved into Q (sign flip of the thread's own chunks
      // once they land): the softmax takes row maxima on raw logits and needs a
      // positive scale.
      // Copy groups in issue order: G0 the Q tile, then K_b = G(2b+1) and
      // V_b = G(2b+2). complete(g), once cp.async has waited for group g, makes
      // its bytes visible to wgmma (the async proxy) and arrives on its barrier.
      auto complete_q = [&](const Tile& qtile, int qb) {
        if (qtile.seq.sm_scale < 0.f) {
#pragma unroll
          for (int p = 0; p < Tr::kQPasses; ++p) {
            const uint32_t at = (a_q(qb) - base) + TileOff<Tr::kM>(p * Tr::kRowsPerPass + r0, c);
            uint4* ptr = reinterpret_cast<uint4*>(smem + at);
            uint4 v = *ptr;
            v.x ^= 0x80008000u; v.y ^= 0x80008000u; v.z ^= 0x80008000u; v.w ^= 0x80008000u;
            *ptr = v;
          }
        }
        FenceProxyAsync();
        MbarArrive(bar_q(qb));
      };
      auto complete = [&](int g) {
        if (g == 0) {
          complete_q(tile, 0);
          return;
        }
        FenceProxyAsync();
        MbarArrive((g & 1) ? bar_k(((g - 1) >> 1) % SK) : bar_v(((g - 2) >> 1) % SV));
      };

      // K and V rows by cp.async: lane (tid % 8) of the producer copies 16-byte
      // chunks tid % 8 + 8 h (h < D / 64) of rows tid / 8 + 16 p (p < KB / 16),
      // so that eight lanes read one 128-byte line and a thread works out one
      // row's address per D / 64 copies (unsigned 32 x 32 -> 64-bit: a slot is
      // below 2^31, the backend checks).
      const uint32_t row_bytes = static_cast<uint32_t>(args.p.geo.num_kv_heads) * D * sizeof(T);
      const int64_t kv_base =
          ((int64_t)seq.layer * args.slots_per_layer * args.p.geo.num_kv_heads + kvh) * D * sizeof(T) + (tid & 7) * 16;
      [[maybe_unused]] const char* k_base = static_cast<const char*>(args.p.k_cache) + kv_base;
      [[maybe_unused]] const char* v_base = static_cast<const char*>(args.p.v_cache) + kv_base;
      const int32_t* pages = args.p.kv_indices + seq.kv_start;
      // Slot of row `tid` of block `block` within the layer (-1: past the
      // end).
      auto row_slot = [&](int block) -> int32_t {
        const int pos = kv_begin + block * KB + tid;
        if (pos >= kv_end) return -1;
        const int page_at = args.page.Div(pos);
        return __ldg(pages + page_at) * args.page.d + (pos - page_at * args.page.d);
      };
      // Rows past the range's end (the last block's) are zero-filled.
      // (Tr::kTma: only a range's partial blocks come this way; a rolled loop
      // leaves the tensor-copy producer registers for its boxes.) A whole
      // block's rows are all valid: their addresses are formed first and the
      // copies then issued back to back, without the zero-fill operand, so
      // that no copy waits for the one before it to read its registers.
      auto issue = [&](const char* src_base, uint32_t dst, const int32_t* slots, int block) {
        const bool whole = kv_begin + (block + 1) * KB <= kv_end;
        if (!Tr::kTma && whole) {
          const char* src[KB / 16];
#pragma unroll
          for (int p = 0; p < KB / 16; ++p) {
            src[p] = src_base + static_cast<uint64_t>(static_cast<uint32_t>(slots[p * 16 + (tid >> 3)])) * row_bytes;
          }
#pragma unroll
          for (int p = 0; p < KB / 16; ++p) {
#pragma unroll
            for (int h = 0; h < D / 64; ++h) {
              CpAsync16(dst + TileOff<KB>(p * 16 + (tid >> 3), (tid & 7) + 8 * h), src[p] + 128 * h);
            }
          }
        } else {
#pragma unroll(Tr::kTma ? 1 : KB / 16)
          for (int p = 0; p < KB / 16; ++p) {
            const int r = p * 16 + (tid >> 3);
            const int32_t slot = slots[r];
            const char* src = src_base + static_cast<uint64_t>(static_cast<uint32_t>(max(slot, 0))) * row_bytes;
#pragma unroll
            for (int h = 0; h < D / 64; ++h) {
              CpAsync16(dst + TileOff<KB>(r, (tid & 7) + 8 * h), src + 128 * h, slot >= 0);
            }
          }
        }
        CpAsyncCommit();
      };

      // Tr::kTma: block `block`'s rows of one cache into the stage at byte
      // `offset` of the tile memory by the tensor copy engine, when the block
      // is whole and its rows come in runs of tma_run (>= 8) consecutive slots
      // (the KV range starts on a run: runs then never cross a page): one box
      // per run and column block, each box 1024-byte aligned in the stage.
      // Each thread with a box first adds its bytes to the stage's barrier
      // with its arrival, then issues it; the others just arrive (128
      // arrivals, as cp.async's). Returns false for a block that is not so
      // (the caller gathers it with cp.async).
      const int32_t layer_slot0 = seq.layer * static_cast<int32_t>(args.slots_per_layer);
      const int run = args.tma_run;
      const bool block_runs = run >= 8 && kv_begin % run == 0;
      auto issue_tma = [&](const CUtensorMap* map, int offset, const int32_t* slots, uint32_t bar, int block) {
        constexpr int kCb = D / 64;  // 128-byte column blocks per row
        if (!block_runs || kv_begin + (block + 1) * KB > kv_end) return false;
        uint64_t* bar_ptr = reinterpret_cast<uint64_t*>(smem + (bar - base));
        // Box i (at most 32) is issued by lane i / 4 of warp i % 4: a warp
        // issues its lanes' copies one after another (one uniform instruction
        // per lane), so the four producer warps share them.
        const int box = (tid & 31) * 4 + (tid >> 5);
        if (box < (KB / run) * kCb) {
          const int row = (box / kCb) * run;
          const int cb = box % kCb;
          MbarArriveExpectTx(bar_ptr, static_cast<uint32_t>(run) * 128);
          TmaLoad3d(smem + offset + cb * (KB * 128) + row * 128, map, cb * 64, kvh, layer_slot0 + slots[row], bar_ptr);
        } else {
          MbarArrive(bar);
        }
        return true;
      };

      // ---- Tr::kFp8: a block's FP8 rows land in the upper half of their
      // stage (Tr::kFp8At), D bytes a row, 16-byte chunk c of row r at
      // Fp8Off(r, c) (at head_dim 128 XOR-swizzled as the tensor copy
      // engine's 128-byte mode lays it out), by whole-row tensor copies
      // (one box per run of rows) or cp.async (lane i of the producer copies
      // chunks i, i + 128, ... of the block's KB * D / 16, so that a warp
      // reads whole rows); convert8 then rewrites the stage as the fp16
      // tile the GEMMs read.
      const uint32_t row_bytes8 = static_cast<uint32_t>(args.p.geo.num_kv_heads) * D;
      const int64_t kv_base8 = ((int64_t)seq.layer * args.slots_per_layer * args.p.geo.num_kv_heads + kvh) * D;
      auto issue8 = [&](const void* cache, uint32_t dst, const int32_t* slots) {
        const char* src_base = static_cast<const char*>(cache) + kv_base8;
        constexpr int kCh = D / 16;  // 16-byte chunks of an FP8 row
        // (Tr::kTma: only a range's partial blocks come this way; a rolled
        // loop leaves the producer registers for its boxes.)
#pragma unroll(Tr::kTma ? 1 : 4)
        for (int i = 0; i < kCh; ++i) {
          const int idx = i * 128 + tid;
          const int r = idx / kCh;
          const int c = idx % kCh;
          const int32_t slot = slots[r];
          const char* src = src_base + static_cast<uint64_t>(static_cast<uint32_t>(max(slot, 0))) * row_bytes8 + c * 16;
          CpAsync16(dst + Fp8Off<D>(r, c), src, slot >= 0);
        }
        CpAsyncCommit();
      };
      // Whole blocks whose rows come in runs (as issue_tma): one box of
      // D bytes x run rows per run.
      auto issue_tma8 = [&](const CUtensorMap* map, int offset, const int32_t* slots, uint32_t bar, int block) {
        if (!block_runs || kv_begin + (block + 1) * KB > kv_end) return false;
        uint64_t* bar_ptr = reinterpret_cast<uint64_t*>(smem + (bar - base));
        const int box = (tid & 31) * 4 + (tid >> 5);
        if (box < KB / run) {
          const int row = box * run;
          MbarArriveExpectTx(bar_ptr, static_cast<uint32_t>(run) * D);
          TmaLoad3d(smem + offset + row * D, map, 0, kvh, layer_slot0 + slots[row], bar_ptr);
        } else {
          MbarArrive(bar);
        }
        return true;
      };
      // Block b's FP8 rows of one cache into the stage's upper half at byte
      // `at`, by tensor copies where issue_tma8 takes the block, else by
      // cp.async; tracked by `land`.
      auto land8 = [&](const CUtensorMap* map, const void* cache, int at, uint32_t land, const int32_t* slots,
                       int b) {
        if (!Tr::kTma || !issue_tma8(map, at, slots, land, b)) {
          issue8(cache, base + at, slots);
          CpAsyncArriveNoinc(land);
        }
      };
      // The stage at byte `stage` of the tile memory, once its FP8 bytes
      // have landed (land, phase), rewritten in place as fp16
      // (ConvertFp8Stage, kernels/sm90/fp8_tiles.cuh), then a fence to the
      // async proxy and the full barrier.
      const bool e5m2 = args.p.geo.kv_fp8 == Fp8Format::kE5m2;
      auto convert8 = [&](int stage, uint32_t land, uint32_t phase, uint32_t full) {
        MbarWait(land, phase);
        ConvertFp8Stage<D, KB>(base + stage, Tr::kFp8At, tid, e5m2);
        FenceProxyAsync();
        MbarArrive(full);
      };
      // kQToHalf: the Q tile of Q phase qp, once landed (q_land), as fp16
      // times 2^e per row (QTileToHalf); e goes to s_qexp for the consumers.
      auto finish_q = [&](int qp, bool negative) {
        const int qb = qp % QB;
        MbarWait(bar_q_land(qb), (qp / QB) & 1);
        QTileToHalf<Tr>(smem + (a_q(qb) - base), s_qexp + qb * Tr::kM, r0, c, negative);
        FenceProxyAsync();
        MbarArrive(bar_q(qb));
      };

      int32_t my_slot = num_blocks > 0 ? row_slot(0) : 0;
      if constexpr (Tr::kOverlap) {
        // kTrace: the producer's stamps of this tile (Sm90Trace::kTileAt).
        Stamps<kTrace> pst(args, Sm90Trace::kTileAt + tile.n * Sm90Trace::kTilePoints,
                           tid == 0 && tile.n < Sm90Trace::kTiles);
        pst.Now(6);
        // The Q tile of Q phase qp (tile qtile) once the consumers have
        // released the buffer's previous tile (after its last S): tracked by
        // q_full like K and V, or waited for and flipped for a negative scale.
        auto load_q = [&](const Tile& qtile, int qp) {
          const int qb = qp % QB;
          if (qp >= QB) MbarWait(bar_q_empty(qb), ((qp / QB) - 1) & 1);
          issue_q(qtile, qb);
          if constexpr (kQToHalf) {
            CpAsyncArriveNoinc(bar_q_land(qb));  // finish_q converts it later
          } else if (qtile.seq.sm_scale < 0.f) {
            CpAsyncWait<0>();
            complete_q(qtile, qb);
          } else {
            CpAsyncArriveNoinc(bar_q(qb));
          }
        };
        // K and V, tracked by the stages' mbarriers (traits.cuh). Block b's
        // slots are shared before its K; block 0's K is issued before Q, and
        // that step is peeled so that Q's addressing is not live across the
        // block loop (the producer has 72 registers).
        Stamps<kTrace> st(args, Sm90Trace::kProducerAt, tid == 0 && first);
        auto issue_k_block = [&](int b) {
          const int g = g0 + b;  // ring position
          const int stage = g % SK;
          const int pt = b < Sm90Trace::kTurns ? b * Sm90Trace::kProducerPoints : -1;
          if (pt >= 0) st.Now(pt + 0);
          int32_t* slots = s_slot + (g & 1) * KB;
          slots[tid] = my_slot;
          NamedBarSync(1, 128);
          if (pt >= 0) st.Now(pt + 1);
          if (b + 1 < num_blocks) my_slot = row_slot(b + 1);  // in flight during the copies
          if (g >= SK) MbarWait(bar_k_empty(stage), ((g / SK) & 1) ^ 1);
          if (pt >= 0) st.Now(pt + 2);
          if constexpr (Tr::kFp8) {
            land8(&args.k_map, args.p.k_cache, Tr::kKOff + stage * Tr::kKvBytes + Tr::kFp8At, bar_k_land(stage), slots,
                  b);
          } else if (!Tr::kTma || !issue_tma(&args.k_map, Tr::kKOff + stage * Tr::kKvBytes, slots, bar_k(stage), b)) {
            issue(k_base, a_k + stage * Tr::kKvBytes, slots, b);
            CpAsyncArriveNoinc(bar_k(stage));
          }
          if (pt >= 0) st.Now(pt + 3);
        };
        auto issue_v_block = [&](int b) {
          const int g = g0 + b;
          const int stage = g % SV;
          const int pt = b < Sm90Trace::kTurns ? b * Sm90Trace::kProducerPoints : -1;
          const int32_t* slots = s_slot + (g & 1) * KB;
          if (g >= SV) MbarWait(bar_v_empty(stage), ((g / SV) & 1) ^ 1);
          if (pt >= 0) st.Now(pt + 4);
          if constexpr (Tr::kFp8) {
            land8(&args.v_map, args.p.v_cache, Tr::kVOff + stage * Tr::kKvBytes + Tr::kFp8At, bar_v_land(stage), slots,
                  b);
          } else if (!Tr::kTma || !issue_tma(&args.v_map, Tr::kVOff + stage * Tr::kKvBytes, slots, bar_v(stage), b)) {
            issue(v_base, a_v + stage * Tr::kKvBytes, slots, b);
            CpAsyncArriveNoinc(bar_v(stage));
          }
          if (pt >= 0) st.Now(pt + 5);
        };
        // Block 0, then this tile's Q unless the previous item's producer
        // loaded it, then block 0's V and the next item's Q (into the other
        // buffer, once its last tile has run its last S: about when block 0
        // of this tile is issued), so that it lands while this tile runs,
        // not after it: a Q load takes longer than the last turn and the
        // epilogue.
        static_assert(QB == 2, "a persistent CTA loads Q a tile ahead");
        // Tr::kFp8: K_b is converted as soon as V_b is issued (the K ring
        // is the short one: K_b's stage frees once S_{b-2} has completed and
        // turn b needs it), V_b once K_{b+1} and V_{b+1} are (its bytes have
        // then had a block's time to land; turn b + 1 needs it). Block 0's
        // K goes before the next tile's Q, whose load waits for the
        // consumers to finish the last tile: they need K_0 right after. The
        // next tile's Q (kQToHalf) is converted once block 1 is, or at the
        // end of a shorter tile: it has landed by then.
        auto convert_k = [&](int b) {
          const int g = g0 + b;
          convert8(Tr::kKOff + (g % SK) * Tr::kKvBytes, bar_k_land(g % SK), (g / SK) & 1, bar_k(g % SK));
        };
        auto convert_v = [&](int b) {
          const int g = g0 + b;
          convert8(Tr::kVOff + (g % SV) * Tr::kKvBytes, bar_v_land(g % SV), (g / SV) & 1, bar_v(g % SV));
        };
        if (num_blocks > 0) issue_k_block(0);
        pst.Now(8);
        if (!tile.q_ahead) load_q(tile, qt);
        if (num_blocks > 0) issue_v_block(0);
        if constexpr (kQToHalf) {
          if (!tile.q_ahead) finish_q(qt, tile.seq.sm_scale < 0.f);
        }
        if constexpr (Tr::kFp8) {
          if (num_blocks > 0) convert_k(0);
        }
        const int next_idx = tile.idx + static_cast<int>(gridDim.x);
        int next_q = 0;  // kQToHalf: 1 the next tile's Q is loaded and not converted, 2 with a negative scale
        if (next_idx < args.num_items) {
          const Tile next = MakeTile<Tr>(args, next_idx);
          if (next.item.seq >= 0) {
            load_q(next, qt + 1);
            next_q = next.seq.sm_scale < 0.f ? 2 : 1;
            // Its first page-table line, for its first block's slots.
            PrefetchL1(args.p.kv_indices + next.seq.kv_start + args.page.Div(next.item.kv_begin));
          }
        }
        pst.Now(7);
        for (int b = 1; b < num_blocks; ++b) {
          issue_k_block(b);
          issue_v_block(b);
          if constexpr (Tr::kFp8) {
            convert_k(b);
            convert_v(b - 1);
          }
          if constexpr (kQToHalf) {
            if (b == 1 && next_q > 0) {
              finish_q(qt + 1, next_q == 2);
              next_q = 0;
            }
          }
        }
        if constexpr (Tr::kFp8) {
          if (num_blocks > 0) convert_v(num_blocks - 1);
        }
        if constexpr (kQToHalf) {
          if (next_q > 0) finish_q(qt + 1, next_q == 2);
        }
      } else {
        // One tile per CTA (Tr::kPersistent is false): ring positions are
        // block indices.
        issue_q(tile, 0);
        for (int b = 0; b < num_blocks; ++b) {
          const int stage = b % SK;  // SK == SV
          int32_t* slots = s_slot + (b & 1) * KB;
          slots[tid] = my_slot;
          NamedBarSync(1, 128);
          if (b + 1 < num_blocks) my_slot = row_slot(b + 1);  // in flight during the copies
          if (b >= SK) MbarWait(bar_k_empty(stage), ((b / SK) & 1) ^ 1);
          // kInFlight groups stay in flight; the oldest beyond them completes.
          issue(k_base, a_k + stage * Tr::kKvBytes, slots, b);
          CpAsyncWait<Tr::kInFlight>();
          if (2 * b + 1 - Tr::kInFlight >= 0) complete(2 * b + 1 - Tr::kInFlight);
          issue(v_base, a_v + stage * Tr::kKvBytes, slots, b);
          CpAsyncWait<Tr::kInFlight>();
          if (2 * b + 2 - Tr::kInFlight >= 0) complete(2 * b + 2 - Tr::kInFlight);
        }
        CpAsyncWait<0>();
        for (int g = max(0, 2 * num_blocks - Tr::kInFlight + 1); g <= 2 * num_blocks; ++g) complete(g);
      }
      return;
    });
    // The copies are signalled on the barriers (kOverlap); the producer
    // leaves none pending.
    CpAsyncWaitAll();
    return;
  }

  RegAlloc<Tr::kConsumerRegs>();
  // Ping-pong: the two consumer warpgroups take turns issuing their GEMMs
  // (named barriers kTurnBar + warpgroup, 256 threads: one warpgroup syncs,
  // the other arrives), so that one's softmax runs beside the other's GEMMs.
  // Warpgroup 0 goes first; every sync meets exactly one arrive, so that no
  // arrival outlives the CTA. kSerial (one tile per CTA): warpgroup 1 gives
  // the first turn and skips its last arrival. kOverlap: the turns run on
  // across the CTA's tiles, so that warpgroup 0 starts the next tile while
  // warpgroup 1 finishes this one; warpgroup 1 gives the first turn of the
  // first tile with KV blocks and arrives after every turn, and warpgroup 0
  // meets its last arrival after the last tile.
  constexpr int kTurnBar = 2;
  bool turns_begun = false;  // kOverlap: this CTA has taken a turn
  ForEachTile<Tr>(args, [&](const Tile& tile, auto&& fetch_next) {
    const PrefillWorkItem& item = tile.item;
    const PrefillSeq& seq = tile.seq;
    const int H = args.p.geo.num_qo_heads;
    const int group = args.group.d;
    const int kvh = item.kv_head;
    const int q_len = seq.q_len;
    const int kv_begin = item.kv_begin;
    const int num_blocks = tile.num_blocks;
    const int g0 = tile.g0;
    const int qt = tile.n;  // Q phase
    const bool first = tile.first;
    // kTrace: consumer warpgroup 0's stamps of this tile (Sm90Trace::kTileAt;
    // warpgroup 1 stamps the end of its epilogue).
    Stamps<kTrace> tst(args, Sm90Trace::kTileAt + tile.n * Sm90Trace::kTilePoints,
                       tid == 128 && tile.n < Sm90Trace::kTiles);
    Stamps<kTrace> tst1(args, Sm90Trace::kTileAt + tile.n * Sm90Trace::kTilePoints,
                        tid == 256 && tile.n < Sm90Trace::kTiles);
    tst.Now(0);
    tst.Put(5, num_blocks);

    // ======================= consumers =======================
    const int cw = wg - 1;               // consumer warpgroup 0 / 1
    const int ctid = tid - 128 * wg;     // thread within the warpgroup
    const int warp = ctid >> 5;
    const int lane = tid & 31;
    const int wg_row0 = cw * Tr::kWgRows;  // first tile row of this warpgroup
    // Thread rows: wg_row0 + warp * 16 + lane / 4 (h = 0) and + 8 (h = 1).
    const int row_base = item.row_begin + wg_row0 + warp * 16 + (lane >> 2);
    const int item_kv_end = item.kv_end;
    // The keys [begin, end) the thread's rows h = 0, 1 see in this item
    // (kernels/variant.h): four registers, in place of the sequence's
    // diagonal, window and causal flag, which the main loop then never
    // needs.
    KeyRange sees[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sees[h] = RowKeysAt(QueryPos(seq, args.group.Div(row_base + h * 8)), seq.window_left,
                          seq.causal != 0, item_kv_end);
    }
    // This warpgroup's rows: the KV positions they see.
    const int wg_t_first = args.group.Div(item.row_begin + wg_row0);
    const int wg_t_last = min(q_len - 1, args.group.Div(item.row_begin + wg_row0 + Tr::kWgRows - 1));
    const bool wg_active = wg_t_first < q_len;
    const TileKeys wg_keys = RowsKeys(seq, wg_t_first, max(wg_t_first, wg_t_last));
    const int wg_kv_end = min(item_kv_end, wg_keys.read.end);
    // Keys every row of the warpgroup sees: a block inside them needs no
    // per-element mask (a test uniform over the warpgroup, so that no warp
    // diverges around the mask).
    const int wg_full_begin = wg_keys.full.begin;
    const int wg_full_end = min(item_kv_end, wg_keys.full.end);
    // Positive scale (Q's sign flipped for a negative one); a soft-capped
    // sequence takes the transform's other branch, uniform over the CTA.
    // Tr::kFp8: K's scale joins the logit scale (V's the output's, in the
    // epilogue).
    float k_scale = 1.f;
    if constexpr (Tr::kFp8) k_scale = KvScaleAt(args.p.k_scales, seq.layer, args.p.geo.num_kv_heads, kvh);
    const LogitTransform logit = LogitTransform::Of(seq, /*positive_scale=*/true, k_scale);
    // kQToHalf: the logit multipliers of the thread's rows h = 0, 1,
    // logit.mul times 2^-e (the producer stored Q times 2^e), read once Q has
    // landed.
    [[maybe_unused]] float row_mul[2] = {logit.mul, logit.mul};

    float o_acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o_acc[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    // A soft-capped row's base-2 logits lie in [-cap, cap] (cap = c log2(e)),
    // so a fixed maximum of cap - kLazyRescale keeps every exponent at most
    // kLazyRescale, as the running maximum does, and spares the softmax its
    // maxima and their shuffles (3-4% of a soft-capped prefill). Only where
    // P is bf16 (fp32's range; fp16's would flush the low exponents) and
    // cap <= kFixedCapMaxBound (traits.cuh).
    constexpr bool kFixedCapMax = Tr::kSoftCap && std::is_same_v<TC, __nv_bfloat16>;
    const bool fixed_max = kFixedCapMax && logit.capped() && logit.cap <= kFixedCapMaxBound;
    if (fixed_max) m_run[0] = m_run[1] = logit.cap - kLazyRescale;
    float l_run[2] = {0.f, 0.f};

    // The GEMMs and the softmax of both schedules. Ring stage and phase of
    // the tile's block t: (g0 + t) (kSerial: g0 = 0, one tile per CTA).
    float s[KB / 2];
    uint32_t p[KB / 16][4];
#pragma unroll
    for (int i = 0; i < KB / 2; ++i) s[i] = 0.f;
#pragma unroll
    for (int j = 0; j < KB / 16; ++j) p[j][0] = p[j][1] = p[j][2] = p[j][3] = 0u;

    auto k_stage = [&](int t) { return (g0 + t) % SK; };
    auto k_phase = [&](int t) -> uint32_t { return ((g0 + t) / SK) & 1; };
    auto v_stage = [&](int t) { return (g0 + t) % SV; };
    auto v_phase = [&](int t) -> uint32_t { return ((g0 + t) / SV) & 1; };
    const int qb = qt % QB;
    const uint32_t a_qt = a_q(qb);
    auto issue_s = [&](int t) {
      const uint32_t k_at = a_k + k_stage(t) * Tr::kKvBytes;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t qa = a_qt + (kk >> 2) * (Tr::kM * 128) + wg_row0 * 128 + (kk & 3) * 32;
        const uint32_t kb = k_at + (kk >> 2) * (KB * 128) + (kk & 3) * 32;
        WgmmaSS<KB, TC>(s, MakeDesc(qa, 16, 1024), MakeDesc(kb, 16, 1024), kk > 0);
      }
      WgmmaCommit();
    };
    auto issue_pv = [&](int b) {
      const uint32_t v_at = a_v + v_stage(b) * Tr::kKvBytes;
#pragma unroll
      for (int j = 0; j < KB / 16; ++j) {
        WgmmaRS<D, TC>(o_acc, p[j], MakeDesc(v_at + j * 16 * 128, KB * 128, 1024));
      }
      WgmmaCommit();
    };
    // Mask (boundary blocks only) and online softmax of S_t in base 2 with
    // the lazy rescale (kernels/sm80: the running max moves only when a
    // row's block max exceeds it by more than kLazyRescale, for the whole
    // warp at once), in place (s becomes P_t in fp32); l_run and m_run move
    // now, O's rescale by alpha is left to rescale_and_pack (the overlapped
    // schedule: after the PV wgmma in flight, which accumulates at the old
    // max). Returns whether O must be rescaled.
    auto softmax = [&](int t, float (&alpha)[2]) -> bool {
      const int block_start = kv_begin + t * KB;
      // A soft-capped sequence's logits become tanh(d * scale / c) in place,
      // before the mask (a masked key's -inf then needs no test), and the
      // exponent's multiplier becomes c * log2(e): beyond the plain path the
      // soft-cap costs one multiply and one MUFU tanh per logit, and one copy
      // of the softmax serves both.
      float mul[2];
      if constexpr (kQToHalf) {
        mul[0] = row_mul[0];
        mul[1] = row_mul[1];
      } else {
        mul[0] = mul[1] = logit.mul;
      }
      if constexpr (Tr::kSoftCap) {
        if (logit.capped()) {
#pragma unroll
          for (int i = 0; i < KB / 2; ++i) s[i] = SoftCapTanh(s[i] * mul[(i >> 1) & 1]);
          mul[0] = mul[1] = logit.cap;
        }
      }
      if (block_start < wg_full_begin || block_start + KB > wg_full_end) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int n = 0; n < KB / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int pos = block_start + n * 8 + (lane & 3) * 2 + e;
              if (pos < sees[h].begin || pos >= sees[h].end) s[4 * n + 2 * h + e] = -INFINITY;
            }
          }
        }
      }
      bool rescale = false;
      alpha[0] = alpha[1] = 1.f;
      if (!fixed_max) {
        float mx2[2];
        bool grow = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < KB / 8; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * h], s[4 * n + 2 * h + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          mx2[h] = mx * mul[h];
          grow |= mx2[h] > m_run[h] + kLazyRescale;
        }
        rescale = __any_sync(0xffffffffu, grow);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float m_new = rescale ? fmaxf(m_run[h], mx2[h]) : m_run[h];
          alpha[h] = rescale ? Exp2(m_run[h] - (m_new == -INFINITY ? 0.f : m_new)) : 1.f;
          m_run[h] = m_new;
          l_run[h] *= alpha[h];
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float neg_m = m_run[h] == -INFINITY ? 0.f : -m_run[h];
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < KB / 8; ++n) {
          const float p0 = Exp2(fmaf(s[4 * n + 2 * h], mul[h], neg_m));
          const float p1 = Exp2(fmaf(s[4 * n + 2 * h + 1], mul[h], neg_m));
          s[4 * n + 2 * h] = p0;
          s[4 * n + 2 * h + 1] = p1;
          sum += p0 + p1;
        }
        l_run[h] += sum;
      }
      return rescale;
    };
    // After the PV wgmma's wait: O to the new max, then P_t packed (the
    // accumulator layout of S is the A-fragment layout).
    auto rescale_and_pack = [&](bool rescale, const float (&alpha)[2]) {
      if (rescale) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            o_acc[4 * n + 2 * h] *= alpha[h];
            o_acc[4 * n + 2 * h + 1] *= alpha[h];
          }
        }
      }
#pragma unroll
      for (int j = 0; j < KB / 16; ++j) {
        p[j][0] = Pack2<TC>(s[8 * j + 0], s[8 * j + 1]);
        p[j][1] = Pack2<TC>(s[8 * j + 2], s[8 * j + 3]);
        p[j][2] = Pack2<TC>(s[8 * j + 4], s[8 * j + 5]);
        p[j][3] = Pack2<TC>(s[8 * j + 6], s[8 * j + 7]);
      }
    };

    if constexpr (!Tr::kOverlap) {
      if (Tr::kPingPong && cw == 1 && num_blocks > 0) NamedBarArrive(kTurnBar + 0, 256);
      if (num_blocks > 0) MbarWait(bar_q(0), 0);
      for (int b = 0; b < num_blocks; ++b) {
        const int block_start = kv_begin + b * KB;
        const bool do_math = wg_active && block_start < wg_kv_end;
        MbarWait(bar_k(k_stage(b)), k_phase(b));
        // Whether this warpgroup hands the turn over after issuing (all but
        // warpgroup 1's last block).
        const bool pass_turn = !(cw == 1 && b == num_blocks - 1);
        if (Tr::kPingPong) NamedBarSync(kTurnBar + cw, 256);
        if (!do_math && Tr::kPingPong && pass_turn) NamedBarArrive(kTurnBar + (1 - cw), 256);
        if (do_math) {
          FenceRegs(s);
          WgmmaFence();
          issue_s(b);
          if (Tr::kPingPong && pass_turn) NamedBarArrive(kTurnBar + (1 - cw), 256);
          WgmmaWait<0>();
          FenceRegs(s);
          float alpha[2];
          const bool rescale = softmax(b, alpha);
          rescale_and_pack(rescale, alpha);  // O to the new max before this block's P V
        }
        MbarWait(bar_v(v_stage(b)), v_phase(b));
        if (do_math) {
          FenceRegs(p);
          FenceRegs(o_acc);
          WgmmaFence();
          issue_pv(b);
          WgmmaWait<0>();
          FenceRegs(o_acc);
          FenceRegs(p);
        }
        MbarArrive(bar_k_empty(k_stage(b)));
      }
    } else {
      // ---- Overlapped schedule. Turn t (0 .. num_blocks) issues S_t = Q K_t^T
      // and O += P_{t-1} V_{t-1} as two wgmma groups, waits for S_t alone,
      // masks it and runs the softmax while PV_{t-1} is on the tensor cores,
      // then waits for PV_{t-1}, rescales O to the new row max and packs P_t.
      // Registers: s (S_t, fp32), p (P_{t-1}, 16-bit, read by the PV wgmma in
      // flight: written only after its wait), o_acc. Releases: K_t once S_t has
      // completed (k_empty), V_{t-1} once PV_{t-1} has (v_empty); a warpgroup
      // without rows at block t still waits for the block to land before it
      // releases it, so that its arrivals count in that block's phase. Both
      // warpgroups take num_blocks + 1 turns (kPingPong: warpgroup 0 first;
      // every sync meets exactly one arrive, as in the serial schedule).
      // This warpgroup computes blocks 0 .. wg_blocks - 1 (a prefix: its
      // rows see keys up to wg_kv_end; keys before a window's start are
      // masked, they are at most the item's first blocks): turn 0 (S_0), turns 1 ..
      // wg_blocks - 1 (S_t and PV_{t-1}), turn wg_blocks (PV alone), then turns
      // without GEMMs. Each wgmma is issued and waited for in the same
      // unconditional stretch of code: ptxas serializes wgmma whose pipeline
      // crosses divergent branches (C7520).
      const int wg_blocks =
          wg_active && wg_kv_end > kv_begin ? min(num_blocks, (wg_kv_end - kv_begin + KB - 1) / KB) : 0;
      const int turns = num_blocks > 0 ? num_blocks + 1 : 0;
      // Stamps of this warpgroup's turns (Sm90Trace), by its first thread.
      Stamps<kTrace> st(args, Sm90Trace::ConsumerAt(cw), ctid == 0 && first);
      auto stamp = [&](int turn, int point) {
        if (turn <= Sm90Trace::kTurns) st.Now(turn * Sm90Trace::kConsumerPoints + point);
      };
      if constexpr (kTrace) {
        Stamps<kTrace> header(args, 0, ctid == 0 && first);
        header.Put(5 + cw, wg_blocks);
      }
      // Waits for K_t (t < num_blocks) and V_{t-1} (t > 0), then for the turn.
      // The producer's copies completed on the barriers (cp.async writes,
      // generic proxy): fence before wgmma reads them (traits.cuh).
      auto turn_begin = [&](int t) {
        stamp(t, 0);
        if (t < num_blocks) MbarWait(bar_k(k_stage(t)), k_phase(t));
        if (t >= 1) MbarWait(bar_v(v_stage(t - 1)), v_phase(t - 1));
        FenceProxyAsync();
        stamp(t, 1);
        if (Tr::kPingPong) NamedBarSync(kTurnBar + cw, 256);
        stamp(t, 2);
      };
      // Hands the turn over.
      auto turn_end = [&]() {
        if (Tr::kPingPong) NamedBarArrive(kTurnBar + (1 - cw), 256);
      };
      if (turns > 0 && Tr::kPingPong && cw == 1 && !turns_begun) NamedBarArrive(kTurnBar + 0, 256);
      if (turns > 0) turns_begun = true;
      // Every tile of a persistent CTA has a Q phase (one without KV blocks
      // too: the producer loads Q a tile ahead, before it knows).
      if (Tr::kPersistent || turns > 0) {
        MbarWait(bar_q(qb), (qt / QB) & 1);
        if constexpr (kQToHalf) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int e = s_qexp[qb * Tr::kM + wg_row0 + warp * 16 + (lane >> 2) + 8 * h];
            row_mul[h] = logit.mul * __int_as_float((127 - e) << 23);
          }
        }
        tst.Now(1);
        // Tr::kPersistent: Q is free once this warpgroup's last S has
        // completed (here, for a warpgroup without blocks).
        if (Tr::kPersistent && wg_blocks == 0) MbarArrive(bar_q_empty(qb));
      }
      int t = 0;
      if (wg_blocks > 0) {
        float alpha[2];
        // Turn 0: S_0 alone.
        turn_begin(0);
        tst.Now(2);
        FenceRegs(s);
        WgmmaFence();
        issue_s(0);
        turn_end();
        WgmmaWait<0>();
        FenceRegs(s);
        MbarArrive(bar_k_empty(k_stage(0)));
        if (Tr::kPersistent && wg_blocks == 1) MbarArrive(bar_q_empty(qb));
        bool rescale = softmax(0, alpha);
        rescale_and_pack(rescale, alpha);
        // Turns 1 .. wg_blocks - 1: S_t with PV_{t-1}.
        for (t = 1; t < wg_blocks; ++t) {
          turn_begin(t);
          FenceRegs(s);
          FenceRegs(p);
          FenceRegs(o_acc);
          WgmmaFence();
          issue_s(t);
          issue_pv(t - 1);
          turn_end();
          stamp(t, 3);
          WgmmaWait<1>();  // S_t; PV_{t-1} may still run
          FenceRegs(s);
          stamp(t, 4);
          MbarArrive(bar_k_empty(k_stage(t)));
          if (Tr::kPersistent && t == wg_blocks - 1) MbarArrive(bar_q_empty(qb));
          rescale = softmax(t, alpha);
          stamp(t, 5);
          // The row sums depend on every exp2 of the softmax: all of it runs
          // before the wait, beside P_{t-1} V_{t-1}.
          OrderBeforeWait(base + Tr::kSinkOff, l_run[0] + l_run[1]);
          WgmmaWait<0>();  // PV_{t-1}
          FenceRegs(o_acc);
          FenceRegs(p);
          stamp(t, 6);
          MbarArrive(bar_v_empty(v_stage(t - 1)));
          rescale_and_pack(rescale, alpha);
          stamp(t, 7);
        }
        // Turn wg_blocks: PV of the last block this warpgroup computes.
        turn_begin(t);
        FenceRegs(p);
        FenceRegs(o_acc);
        WgmmaFence();
        issue_pv(t - 1);
        turn_end();
        WgmmaWait<0>();
        FenceRegs(o_acc);
        FenceRegs(p);
        if (t < num_blocks) MbarArrive(bar_k_empty(k_stage(t)));
        MbarArrive(bar_v_empty(v_stage(t - 1)));
        ++t;
      }
      // Turns without GEMMs (blocks past this warpgroup's rows, or none).
      for (; t < turns; ++t) {
        turn_begin(t);
        turn_end();
        if (t < num_blocks) MbarArrive(bar_k_empty(k_stage(t)));
        if (t >= 1) MbarArrive(bar_v_empty(v_stage(t - 1)));
      }
    }

    tst.Now(3);
    tst1.Now(11);
    fetch_next();
    // ---- Epilogue: normalise, LSE (base 2 internally), write. The item of
    // chunk 0 carries the rows' sinks (kernels/variant.h, EndRow).
    float inv[2];
    float lse2[2];
    // Read here, not kept from the tile's start: a register the main loop
    // does not hold.
    int sink_index = -1;
    if constexpr (Tr::kSinks) {
      if (item.chunk == 0) sink_index = __ldg(&args.p.seqs[item.seq].sink_index);
    }
    const bool sinks = sink_index >= 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      float sink2 = -INFINITY;
      if (sinks) {
        const int pr = row_base + h * 8;
        const int t = args.group.Div(pr);
        if (t < q_len) sink2 = __ldg(args.p.sinks + (int64_t)sink_index * H + kvh * group + (pr - t * group)) * kLog2e;
      }
      // l >= 1 when positive (the row max contributes exp2(0) before any
      // lazy growth, at most 2^kLazyRescale since): EndRow's approximate
      // reciprocal and log2 (MUFU, a few ulp) are exact enough.
      const RowEnd end = EndRow(m_run[h], l, sink2);
      inv[h] = end.o_scale;
      if constexpr (Tr::kFp8) inv[h] *= KvScaleAt(args.p.v_scales, seq.layer, args.p.geo.num_kv_heads, kvh);
      lse2[h] = end.lse2;
    }
    tst.Now(10);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int pr = row_base + h * 8;
      const int t = args.group.Div(pr);
      const int head = kvh * group + (pr - t * group);
      if (item.part_base < 0) {
        // Final output: the quad's four lanes hold 2 columns each of every
        // 8-column chunk n; after a 4 x 4 transpose within the quad per 4
        // chunks, lane j holds whole chunks n = 4 m + j and writes each with
        // one 16-byte store (a warp writes 64 contiguous bytes of each of
        // its 8 rows, not 16).
        T* dst = static_cast<T*>(args.p.o) + ((int64_t)(seq.q_start + t) * H + head) * D + (lane & 3) * 8;
#pragma unroll
        for (int m = 0; m < D / 32; ++m) {
          uint32_t w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int n = 4 * m + k;
            w[k] = Pack2<T>(o_acc[4 * n + 2 * h] * inv[h], o_acc[4 * n + 2 * h + 1] * inv[h]);
          }
          QuadTranspose(w, lane & 3);
          if (t < q_len) *reinterpret_cast<uint4*>(dst + m * 32) = make_uint4(w[0], w[1], w[2], w[3]);
        }
        if (t < q_len && (lane & 3) == 0) {
          args.p.lse[(int64_t)(seq.q_start + t) * H + head] = seq.lse_base_e ? lse2[h] * kLn2 : lse2[h];
        }
        continue;
      }
      if (t >= q_len) continue;
      {
        // Split chunk: fp32 partial (o, lse) into the workspace.
        const int64_t pair = (int64_t)item.part_base + (int64_t)t * H + head;
        float* dst = args.part_o + pair * D + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          *reinterpret_cast<float2*>(dst + n * 8) =
              make_float2(o_acc[4 * n + 2 * h] * inv[h], o_acc[4 * n + 2 * h + 1] * inv[h]);
        }
        if ((lane & 3) == 0) args.part_lse[pair] = lse2[h];
      }
    }
    if constexpr (kTrace) {
      Stamps<kTrace> header(args, 0, (tid & 127) == 0 && first);
      header.Now(2 + (wg - 1));
    }
    tst.Now(4);
    tst1.Now(9);
  });
  if (Tr::kOverlap && Tr::kPingPong && wg == 1 && turns_begun) NamedBarSync(kTurnBar + 0, 256);
}

#if ATTNSERVE_SM90_DEVICE
#define ATTNSERVE_SM90_BODY(...) PrefillCta<__VA_ARGS__>(args)
#else
// Built for another architecture: the launch refuses devices other than
// sm_90 (PagedPrefillSm90), so this body never runs.
#define ATTNSERVE_SM90_BODY(...) __trap()
#endif

// The serial schedule (PrefillKernel::kSm90).
template <int D, typename T>
__global__ void __launch_bounds__(384, 1) PagedPrefillSm90Kernel(const __grid_constant__ PrefillKernelArgs args) {
  ATTNSERVE_SM90_BODY(Traits<D, Schedule::kSerial, true>, T);
}

// The overlapped schedule, with or without turns between the consumer
// warpgroups (PrefillKernel::kSm90Overlap, kSm90OverlapNoPp); kTrace: with
// clock64 stamps (PagedPrefillSm90Traced).
// kTma: K and V by the tensor copy engine (Traits); the tensor maps are read
// from the kernel's parameter space (__grid_constant__).
// kSoftCap, kSinks: with soft-caps, sinks (Traits).
// kFp8: on FP8 pools (Traits::kFp8; T is the queries' and outputs' type).
template <int D, typename T, bool kPingPong, bool kTrace = false, bool kTma = false, bool kSoftCap = true,
          bool kSinks = true, bool kFp8 = false>
__global__ void __launch_bounds__(384, 1) PagedPrefillSm90OverlapKernel(const __grid_constant__ PrefillKernelArgs args) {
  ATTNSERVE_SM90_BODY(Traits<D, Schedule::kOverlap, kPingPong, kTma, kSoftCap, kSinks, kFp8>, T, kTrace);
}

#undef ATTNSERVE_SM90_BODY

}  // namespace sm90
}  // namespace attnserve
