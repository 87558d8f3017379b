// The sm90 paged prefill kernel's producer (warpgroup 0; kernels/sm90/
// prefill_kernel.cuh says how the roles meet): for each of the CTA's
// tiles, the Q tile and the K / V blocks into their buffers and rings, by
// cp.async or the tensor copy engine; and on FP8 pools (Tr::kFp8) the
// converters' role (warpgroup 3), which rewrites each landed block as fp16
// in place.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/fp8_device.cuh"
#include "kernels/sm90/cta.cuh"
#include "kernels/sm90/fp8_tiles.cuh"
#include "kernels/sm90/ptx.cuh"
#include "kernels/sm90/traits.cuh"

namespace attnserve {
namespace sm90 {

// Tr::kFp8: the converters (warpgroup 3; t is the thread, 0 .. 127). For
// each of the CTA's tiles, in the order the consumers read them: a landed
// stage's FP8 bytes (the producer's land barrier) rewritten in place as
// fp16 (ConvertFp8Stage), then a fence to the async proxy and the stage's
// full barrier. Order: K_0, then K_b before V_{b-1} (turn b's S reads K_b,
// its P V V_{b-1}); Tr::kFp8Q: V blocks alone. (bf16 Q tiles are the
// consumers' to convert: each
// warpgroup its own rows, QRowsToHalf.) No deadlock: each wait is for bytes
// the producer issues without waiting on anything but stages the consumers
// release after reading earlier conversions.
template <typename Tr>
__device__ __forceinline__ void ConverterRole(const PrefillKernelArgs& args, const CtaSmem<Tr>& cs, int t) {
  constexpr int D = Tr::kD;
  constexpr int KB = Tr::kKB;
  constexpr int SK = Tr::kKStages;
  constexpr int SV = Tr::kVStages;
  constexpr int kConvertBar = 4;  // named barrier of the 128 converters (head_dim 64)
  static_assert(Tr::kConvertThreads == 128, "ConvertFp8Stage takes 128 threads");
  RegDealloc<Tr::kConverterRegs>();
  const bool e5m2 = args.p.geo.kv_fp8 == Fp8Format::kE5m2;
  // The stage at byte `stage` of the tile memory, once its FP8 bytes have
  // landed (land, phase), as fp16; then the full barrier.
  auto convert8 = [&](int stage, uint32_t land, uint32_t phase, uint32_t full) {
    MbarWait(land, phase);
    ConvertFp8Stage<D, KB>(cs.base + stage, Tr::kFp8At, t, kConvertBar, e5m2);
    FenceProxyAsync();
    MbarArrive(full);
  };
  ForEachTile<Tr>(args, [&](const Tile& tile, auto&&) {
    const int num_blocks = tile.num_blocks;
    const int g0 = tile.g0;
    auto convert_k = [&](int b) {
      const int g = g0 + b;
      convert8(Tr::kKOff + (g % SK) * Tr::kKvBytes, cs.bar_k_land(g % SK), (g / SK) & 1, cs.bar_k(g % SK));
    };
    auto convert_v = [&](int b) {
      const int g = g0 + b;
      convert8(Tr::kVOff + (g % SV) * Tr::kKvBytes, cs.bar_v_land(g % SV), (g / SV) & 1, cs.bar_v(g % SV));
    };
    if constexpr (Tr::kFp8Q) {
      // K's bytes go to the FP8 wgmma as they landed: V blocks alone.
      for (int b = 0; b < num_blocks; ++b) convert_v(b);
    } else {
      if (num_blocks > 0) convert_k(0);
      for (int b = 1; b < num_blocks; ++b) {
        convert_k(b);
        convert_v(b - 1);
      }
      if (num_blocks > 0) convert_v(num_blocks - 1);
    }
  });
}

template <typename Tr, typename T, bool kTrace>
__device__ __forceinline__ void ProducerRole(const PrefillKernelArgs& args, const CtaSmem<Tr>& cs, int tid) {
  constexpr int D = Tr::kD;
  constexpr int KB = Tr::kKB;
  constexpr int SK = Tr::kKStages;
  constexpr int SV = Tr::kVStages;
  constexpr int QB = Tr::kQBufs;
  constexpr bool kConsumersConvertQ = GemmTypes<Tr, T>::kConsumersConvertQ;
  uint8_t* const smem = cs.smem;
  const uint32_t base = cs.base;
  int32_t* const s_slot = cs.s_slot;
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
    // Unused by the serial schedule (one tile a CTA, no ring across tiles).
    [[maybe_unused]] const int g0 = tile.g0;
    [[maybe_unused]] const int qt = tile.n;  // Q phase
    [[maybe_unused]] const bool first = tile.first;
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
      // (Tr::kFp8: unrolled by 4; unrolled whole, the passes' addresses
      // would take the producer more than its 40 registers.)
#pragma unroll(Tr::kFp8 ? 4 : 1)
      for (int p0 = 0; p0 < Tr::kQPasses; p0 += Tr::kQUnroll) {
#pragma unroll
        for (int p = p0; p < p0 + Tr::kQUnroll; ++p) {
          const bool valid = t < qtile.seq.q_len;
          const T* src = valid ? head0 + (static_cast<int64_t>(t) * H + g) * D : q;
          CpAsync16(cs.a_q(qb) + TileOff<Tr::kM>(p * Tr::kRowsPerPass + r0, c), src, valid);
          t += dt;
          g += dg;
          if (g >= group) {
            g -= group;
            ++t;
          }
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
          const uint32_t at = (cs.a_q(qb) - base) + TileOff<Tr::kM>(p * Tr::kRowsPerPass + r0, c);
          uint4* ptr = reinterpret_cast<uint4*>(smem + at);
          uint4 v = *ptr;
          v.x ^= 0x80008000u; v.y ^= 0x80008000u; v.z ^= 0x80008000u; v.w ^= 0x80008000u;
          *ptr = v;
        }
      }
      FenceProxyAsync();
      MbarArrive(cs.bar_q(qb));
    };
    auto complete = [&](int g) {
      if (g == 0) {
        complete_q(tile, 0);
        return;
      }
      FenceProxyAsync();
      MbarArrive((g & 1) ? cs.bar_k(((g - 1) >> 1) % SK) : cs.bar_v(((g - 2) >> 1) % SV));
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
    // reads whole rows); the converters (ConverterRole) then rewrite the
    // stage as the fp16 tile the GEMMs read.
    const uint32_t row_bytes8 = static_cast<uint32_t>(args.p.geo.num_kv_heads) * D;
    const int64_t kv_base8 = ((int64_t)seq.layer * args.slots_per_layer * args.p.geo.num_kv_heads + kvh) * D;
    auto issue8 = [&](const void* cache, uint32_t dst, const int32_t* slots, int block) {
      const char* src_base = static_cast<const char*>(cache) + kv_base8;
      constexpr int kCh = D / 16;  // 16-byte chunks of an FP8 row
      // A whole block's rows are all valid (as in `issue`): the addresses
      // first, then the copies back to back without the zero-fill operand.
      // Chunk i * 128 + tid is row i * (128 / kCh) + tid / kCh, chunk tid % kCh.
      if (!Tr::kTma && kv_begin + (block + 1) * KB <= kv_end) {
        constexpr int kRowsPerStep = 128 / kCh;
        const int c = tid % kCh;
        const char* src[kCh];
#pragma unroll
        for (int i = 0; i < kCh; ++i) {
          const int r = i * kRowsPerStep + tid / kCh;
          src[i] = src_base + static_cast<uint64_t>(static_cast<uint32_t>(slots[r])) * row_bytes8 + c * 16;
        }
#pragma unroll
        for (int i = 0; i < kCh; ++i) CpAsync16(dst + Fp8Off<D>(i * kRowsPerStep + tid / kCh, c), src[i]);
        CpAsyncCommit();
        return;
      }
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
        issue8(cache, base + at, slots, b);
        CpAsyncArriveNoinc(land);
      }
    };
    int32_t my_slot = num_blocks > 0 ? row_slot(0) : 0;
    if constexpr (Tr::kOverlap) {
      // kTrace: the producer's stamps of this tile (Sm90Trace::kTileAt).
      Stamps<kTrace> pst(args, Sm90Trace::kTileAt + tile.n * Sm90Trace::kTilePoints,
                         tid == 0 && tile.n < Sm90Trace::kTiles);
      pst.Now(6);
      // The Q tile of Q phase qp (tile qtile) once the consumers have
      // released the buffer's previous tile (after its last S): tracked by
      // q_full like K and V, or waited for and flipped for a negative scale
      // (kConsumersConvertQ: the consumers flip it as they convert it).
      auto load_q = [&](const Tile& qtile, int qp) {
        const int qb = qp % QB;
        if (qp >= QB) MbarWait(cs.bar_q_empty(qb), ((qp / QB) - 1) & 1);
        issue_q(qtile, qb);
        if (!kConsumersConvertQ && qtile.seq.sm_scale < 0.f) {
          CpAsyncWait<0>();
          complete_q(qtile, qb);
        } else {
          CpAsyncArriveNoinc(cs.bar_q(qb));
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
        if (g >= SK) MbarWait(cs.bar_k_empty(stage), ((g / SK) & 1) ^ 1);
        if (pt >= 0) st.Now(pt + 2);
        if constexpr (Tr::kFp8) {
          land8(&args.k_map, args.p.k_cache, Tr::kKOff + stage * Tr::kKvBytes + Tr::kFp8At, cs.bar_k_land(stage), slots,
                b);
        } else if (!Tr::kTma || !issue_tma(&args.k_map, Tr::kKOff + stage * Tr::kKvBytes, slots, cs.bar_k(stage), b)) {
          issue(k_base, cs.a_k + stage * Tr::kKvBytes, slots, b);
          CpAsyncArriveNoinc(cs.bar_k(stage));
        }
        if (pt >= 0) st.Now(pt + 3);
      };
      auto issue_v_block = [&](int b) {
        const int g = g0 + b;
        const int stage = g % SV;
        const int pt = b < Sm90Trace::kTurns ? b * Sm90Trace::kProducerPoints : -1;
        const int32_t* slots = s_slot + (g & 1) * KB;
        if (g >= SV) MbarWait(cs.bar_v_empty(stage), ((g / SV) & 1) ^ 1);
        if (pt >= 0) st.Now(pt + 4);
        if constexpr (Tr::kFp8) {
          land8(&args.v_map, args.p.v_cache, Tr::kVOff + stage * Tr::kKvBytes + Tr::kFp8At, cs.bar_v_land(stage), slots,
                b);
        } else if (!Tr::kTma || !issue_tma(&args.v_map, Tr::kVOff + stage * Tr::kKvBytes, slots, cs.bar_v(stage), b)) {
          issue(v_base, cs.a_v + stage * Tr::kKvBytes, slots, b);
          CpAsyncArriveNoinc(cs.bar_v(stage));
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
      if (num_blocks > 0) issue_k_block(0);
      pst.Now(8);
      if (!tile.q_ahead) load_q(tile, qt);
      if (num_blocks > 0) issue_v_block(0);
      const int next_idx = tile.idx + static_cast<int>(gridDim.x);
      if (next_idx < args.num_items) {
        const Tile next = MakeTile<Tr>(args, next_idx);
        if (next.item.seq >= 0) {
          load_q(next, qt + 1);
          // Its first page-table line, for its first block's slots.
          PrefetchL1(args.p.kv_indices + next.seq.kv_start + args.page.Div(next.item.kv_begin));
        }
      }
      pst.Now(7);
      for (int b = 1; b < num_blocks; ++b) {
        issue_k_block(b);
        issue_v_block(b);
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
        if (b >= SK) MbarWait(cs.bar_k_empty(stage), ((b / SK) & 1) ^ 1);
        // kInFlight groups stay in flight; the oldest beyond them completes.
        issue(k_base, cs.a_k + stage * Tr::kKvBytes, slots, b);
        CpAsyncWait<Tr::kInFlight>();
        if (2 * b + 1 - Tr::kInFlight >= 0) complete(2 * b + 1 - Tr::kInFlight);
        issue(v_base, cs.a_v + stage * Tr::kKvBytes, slots, b);
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
}

}  // namespace sm90
}  // namespace attnserve
