// The sm90 paged prefill kernel's consumers (warpgroups 1 and 2; kernels/
// sm90/prefill_kernel.cuh says how the roles meet): for each of the CTA's
// tiles, S = Q K^T, the mask and the online softmax, O += P V, in turns
// with the other warpgroup, and the epilogue.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/fp8_device.cuh"
#include "kernels/math.h"
#include "kernels/sm90/cta.cuh"
#include "kernels/sm90/fp8_tiles.cuh"
#include "kernels/sm90/ptx.cuh"
#include "kernels/sm90/traits.cuh"
#include "kernels/variant.h"

namespace attnserve {
namespace sm90 {

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

// Folds a[0 .. 2W) and b[0 .. 2W) pairwise into a[0] and b[0]: a tree of
// log2(2W) levels, the two arrays' levels side by side.
template <int W, int N, typename Op>
__device__ __forceinline__ void TreeFold(float (&a)[N], float (&b)[N], Op op) {
  static_assert(W >= 1 && 2 * W <= N && (W & (W - 1)) == 0, "a power of two");
#pragma unroll
  for (int n = 0; n < W; ++n) {
    a[n] = op(a[n], a[n + W]);
    b[n] = op(b[n], b[n + W]);
  }
  if constexpr (W > 1) TreeFold<W / 2>(a, b, op);
}

template <typename Tr, typename T, bool kTrace>
__device__ __forceinline__ void ConsumerRole(const PrefillKernelArgs& args, const CtaSmem<Tr>& cs, int tid, int wg) {
  constexpr int D = Tr::kD;
  constexpr int KB = Tr::kKB;
  // Interleaved chains of the softmax's row maxima (a power of two; see
  // softmax): four in the plain kernels on 16-bit pools; one on FP8 pools,
  // where more chains measured slower on `batch` and 32 x 512 (an H100,
  // same-call A/B: bench/results/2026-12-07-session44-h100.md), and in the
  // kernels with soft-caps or sinks, whose registers then spill.
  constexpr int kChains = Tr::kFp8 || Tr::kSoftCap || Tr::kSinks ? 1 : 4;
  constexpr int SK = Tr::kKStages;
  constexpr int SV = Tr::kVStages;
  constexpr int QB = Tr::kQBufs;
  using TC = typename GemmTypes<Tr, T>::TC;
  constexpr bool kQToHalf = GemmTypes<Tr, T>::kQToHalf;
  // Each row's logit multiplier carries 2^-e of its query row's conversion
  // (fp16 or FP8 queries times 2^e).
  constexpr bool kRowExp = GemmTypes<Tr, T>::kConsumersConvertQ;
  const uint32_t base = cs.base;
  int8_t* const s_qexp = cs.s_qexp;
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
    [[maybe_unused]] const bool first = tile.first;  // kTrace only
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
    // kRowExp: the logit multipliers of the thread's rows h = 0, 1,
    // logit.mul times 2^-e (Q is stored times 2^e), read once the
    // warpgroup has converted its rows.
    [[maybe_unused]] float row_mul[2] = {logit.mul, logit.mul};

    float o_acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o_acc[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};
    // A soft-capped row's base-2 logits lie in [-cap, cap] (cap = c log2(e)),
    // so a fixed maximum of cap - kLazyRescale keeps every exponent at most
    // kLazyRescale, as the running maximum does, and spares the softmax its
    // maxima and their shuffles (2-4% of a soft-capped prefill). Only where
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
    const uint32_t a_qt = cs.a_q(qb);
    auto issue_s = [&](int t) {
      const uint32_t k_at = cs.a_k + k_stage(t) * Tr::kKvBytes;
      if constexpr (Tr::kFp8Q) {
        // E4M3 Q rows (the tile's first column block) times K's stored
        // bytes (the stage's upper half, Tr::kFp8At; E4M3 or E5M2): 32
        // elements a step.
#pragma unroll
        for (int kk = 0; kk < D / 32; ++kk) {
          WgmmaSSFp8<Tr::kFp8QKE5m2>(s, MakeDesc(a_qt + wg_row0 * 128 + kk * 32, 16, 1024),
                      MakeDesc(k_at + Tr::kFp8At + kk * 32, 16, 1024), kk > 0);
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint32_t qa = a_qt + (kk >> 2) * (Tr::kM * 128) + wg_row0 * 128 + (kk & 3) * 32;
          const uint32_t kb = k_at + (kk >> 2) * (KB * 128) + (kk & 3) * 32;
          WgmmaSS<KB, TC>(s, MakeDesc(qa, 16, 1024), MakeDesc(kb, 16, 1024), kk > 0);
        }
      }
      WgmmaCommit();
    };
    auto issue_pv = [&](int b) {
      const uint32_t v_at = cs.a_v + v_stage(b) * Tr::kKvBytes;
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
      if constexpr (kRowExp) {
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
        // Each row's block maximum over the thread's KB / 4 logits, times
        // its multiplier. With kChains > 1 in that many interleaved chains,
        // then folded (KB / 8 / kChains + log2(kChains) dependent steps
        // instead of a chain of KB / 8; the same value), both rows' chains
        // and shuffles side by side; with one, a row at a time.
        float mx2[2];
        bool grow = false;
        if constexpr (kChains == 1) {
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
        } else {
          float v[2][kChains];
#pragma unroll
          for (int n = 0; n < KB / 8; ++n) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const float x = fmaxf(s[4 * n + 2 * h], s[4 * n + 2 * h + 1]);
              v[h][n % kChains] = n < kChains ? x : fmaxf(v[h][n % kChains], x);
            }
          }
          TreeFold<kChains / 2>(v[0], v[1], [](float a, float b) { return fmaxf(a, b); });
#pragma unroll
          for (int o = 1; o <= 2; o <<= 1) {
            const float x0 = __shfl_xor_sync(0xffffffffu, v[0][0], o);
            const float x1 = __shfl_xor_sync(0xffffffffu, v[1][0], o);
            v[0][0] = fmaxf(v[0][0], x0);
            v[1][0] = fmaxf(v[1][0], x1);
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            mx2[h] = v[h][0] * mul[h];
            grow |= mx2[h] > m_run[h] + kLazyRescale;
          }
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
      if (num_blocks > 0) MbarWait(cs.bar_q(0), 0);
      for (int b = 0; b < num_blocks; ++b) {
        const int block_start = kv_begin + b * KB;
        const bool do_math = wg_active && block_start < wg_kv_end;
        MbarWait(cs.bar_k(k_stage(b)), k_phase(b));
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
        MbarWait(cs.bar_v(v_stage(b)), v_phase(b));
        if (do_math) {
          FenceRegs(p);
          FenceRegs(o_acc);
          WgmmaFence();
          issue_pv(b);
          WgmmaWait<0>();
          FenceRegs(o_acc);
          FenceRegs(p);
        }
        MbarArrive(cs.bar_k_empty(k_stage(b)));
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
      // Rows written through the generic proxy (the producer's cp.async
      // copies, completed on the barriers) are seen by wgmma, which reads
      // through the async proxy, only after a proxy fence (traits.cuh). On
      // FP8 pools the converters fence their own writes before they
      // complete a stage, and converted bf16 queries are fenced where they
      // are converted: there a turn fences only for fp16 queries (cp.async
      // rows) at turn 0 (+0.6-1.3% on FP8 prefill; on 16-bit pools, fencing
      // only for cp.async blocks, not tensor copies, was 1-3% slower at
      // page_size 16 and 64: bench/results/2026-12-04-session25-h200.md).
      // Tr::kFp8Q: K's stored bytes go to wgmma as they landed, so every turn
      // fences, as on 16-bit pools.
      auto fences = [&](int t) { return Tr::kFp8 && !Tr::kFp8Q ? (t == 0 && !kQToHalf) : true; };
      // K_t's barrier: Tr::kFp8Q reads the landed bytes (land), the other
      // FP8 kernels the converted stage (full).
      auto k_ready = [&](int t) { return Tr::kFp8Q ? cs.bar_k_land(k_stage(t)) : cs.bar_k(k_stage(t)); };
      // Waits for K_t (t < num_blocks) and V_{t-1} (t > 0), then for the turn.
      auto turn_begin = [&](int t) {
        stamp(t, 0);
        if (t < num_blocks) MbarWait(k_ready(t), k_phase(t));
        if (t >= 1) MbarWait(cs.bar_v(v_stage(t - 1)), v_phase(t - 1));
        if (fences(t)) FenceProxyAsync();
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
        MbarWait(cs.bar_q(qb), (qt / QB) & 1);
        tst.Now(12);
        if constexpr (kRowExp) {
          // This warpgroup's rows of the landed tile rewritten for its
          // GEMMs once the warpgroup has synced (named barrier 5 + cw): bf16
          // as fp16 times 2^e (kQToHalf, QRowsToHalf), or Tr::kFp8Q either
          // type as E4M3 times 2^e over the tile's first column block
          // (QRowsToFp8); a negative scale's sign folded in, the rows'
          // exponents beside the tile.
          if (wg_blocks > 0) {
            uint8_t* const q_tile = cs.smem + (a_qt - base);
            if constexpr (Tr::kFp8Q) {
              QRowsToFp8<Tr, T, Tr::kWgRows>(q_tile, s_qexp + qb * Tr::kM, wg_row0, ctid / Tr::kChunks,
                                            ctid % Tr::kChunks, seq.sm_scale < 0.f);
            } else {
              QRowsToHalf<Tr, Tr::kWgRows>(q_tile, s_qexp + qb * Tr::kM, wg_row0, ctid / Tr::kChunks,
                                           ctid % Tr::kChunks, seq.sm_scale < 0.f);
            }
            FenceProxyAsync();
            NamedBarSync(5 + cw, 128);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int e = s_qexp[qb * Tr::kM + wg_row0 + warp * 16 + (lane >> 2) + 8 * h];
              row_mul[h] = logit.TimesPow2(__int_as_float((127 - e) << 23)).mul;
            }
          }
        }
        tst.Now(1);
        // Tr::kPersistent: Q is free once this warpgroup's last S has
        // completed (here, for a warpgroup without blocks).
        if (Tr::kPersistent && wg_blocks == 0) MbarArrive(cs.bar_q_empty(qb));
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
        MbarArrive(cs.bar_k_empty(k_stage(0)));
        if (Tr::kPersistent && wg_blocks == 1) MbarArrive(cs.bar_q_empty(qb));
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
          MbarArrive(cs.bar_k_empty(k_stage(t)));
          if (Tr::kPersistent && t == wg_blocks - 1) MbarArrive(cs.bar_q_empty(qb));
          rescale = softmax(t, alpha);
          stamp(t, 5);
          // The row sums depend on every exp2 of the softmax: all of it runs
          // before the wait, beside P_{t-1} V_{t-1}.
          OrderBeforeWait(base + Tr::kSinkOff, l_run[0] + l_run[1]);
          WgmmaWait<0>();  // PV_{t-1}
          FenceRegs(o_acc);
          FenceRegs(p);
          stamp(t, 6);
          MbarArrive(cs.bar_v_empty(v_stage(t - 1)));
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
        if (t < num_blocks) MbarArrive(cs.bar_k_empty(k_stage(t)));
        MbarArrive(cs.bar_v_empty(v_stage(t - 1)));
        ++t;
      }
      // Turns without GEMMs (blocks past this warpgroup's rows, or none).
      for (; t < turns; ++t) {
        turn_begin(t);
        turn_end();
        if (t < num_blocks) MbarArrive(cs.bar_k_empty(k_stage(t)));
        if (t >= 1) MbarArrive(cs.bar_v_empty(v_stage(t - 1)));
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

}  // namespace sm90
}  // namespace attnserve
