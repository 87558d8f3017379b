// Paged decode attention (few query rows per sequence) on mma.sync, sm_80+.
//
// One CTA per DecodeWorkItem: 4 warps share one packed Q tile (every query
// head of the KV group x every query row of the sequence, 16 * MT rows) and
// split the item's KV range between them in steps of 16 tokens (warp w takes
// steps w, w + 4, ...; a main-loop iteration takes kStepsPerIter of them,
// traits.cuh). Each warp streams its own K/V through a private
// kStages-deep cp.async ring (16-byte copies, no CTA barrier in the main
// loop), with the page-table entries of the next iteration's copies loaded
// one iteration ahead. S = Q K^T and O += P V are m16n8k16 MMAs with the packed
// rows as M; online softmax in base 2. At the end the 4 warps' states are
// combined through shared memory. Split items write an fp32 partial and
// count themselves done on the tile's counter; the last one merges the
// tile's partials and writes o / lse (decode_plan.h). In cluster mode
// (sm_90) the chunks of a tile are one thread-block cluster and merge
// through distributed shared memory instead.
//
// FP8 pools (F8: an Fp8Format; 0 for a 16-bit pool): the ring holds FP8
// rows (twice the steps in flight in the same bytes) and the fragments are
// read from it with plain shared loads and dequantized in registers to
// fp16 (Fp8x4ToHalf: exact; one instruction a pair for E4M3 on sm_89+). Both
// MMAs run in fp16 whatever T is: bf16 queries are stored in shared memory
// as fp16 times a power of two chosen per row (QHalfExponent: exact but for
// elements below 2^-28 of the row's largest), which the row's logit scale
// takes back. The head dimension is permuted so that each thread's K
// bytes are contiguous: logical element p of 16-element block kk of the
// S = Q K^T MMA is physical dimension ((p & 7) >> 1) * D/4 + kk * 4 +
// (p >> 3) * 2 + (p & 1), Q is stored in shared memory in that order, and
// the dot product does not change. For O += P V, column n of n-tile nt is
// physical dimension n * D/8 + nt (the epilogue writes O back in order)
// (P in [0, 1] and every FP8 value are exact or finer in fp16 than in
// bf16). K's scale is folded into the logit transform, V's into the output
// factor.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/decode/decode_cuda.h"
#include "kernels/decode/epilogue.cuh"
#include "kernels/decode/traits.cuh"
#include "kernels/math.h"
#include "kernels/sm80/mma.cuh"
#include "kernels/variant.h"

namespace attnserve {
namespace decode {

// Resident CTAs per SM the kernel is compiled for: 3 for FP8 pools with one
// m-tile at head_dim 64 / 128 (their registers fit), 4 for the kFour kernel
// (128 registers, DecodeTraits), else 2.
template <int D, int MT, int F8, bool kFour = false>
constexpr int DecodeMinBlocks() {
  return kFour ? 4 : F8 != 0 && MT == 1 && D <= 128 ? 3 : 2;
}

template <int D, int MT, typename T, int F8, bool kFour = false>
__global__ void __launch_bounds__(128, (DecodeMinBlocks<D, MT, F8, kFour>()))
    PagedDecodeKernel(const DecodeKernelArgs args) {
  using Tr = DecodeTraits<D, MT, F8 != 0, kFour>;
  constexpr int kM = Tr::kM;
  constexpr bool kFp8 = F8 != 0;
  constexpr int kStages = kFp8 ? Tr::kStages8 : Tr::kStages;
  constexpr int kStageBytes = kFp8 ? Tr::kStageBytes8 : Tr::kStageBytes;
  constexpr int kNs = Tr::kStepsPerIter;  // steps a main-loop iteration takes
  static_assert(kStages > kNs, "a step in flight while an iteration computes");
  // FP8 pools with bf16 queries: S = Q K^T in fp16 (QHalfExponent).
  constexpr bool kQHalf = kFp8 && std::is_same<T, __nv_bfloat16>::value;
  using TS = typename std::conditional<kFp8, __half, T>::type;  // S's operands
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  uint8_t* s_q = smem;
  const uint32_t a_q = mma::SmemAddr(s_q);
  uint8_t* const ring = smem + Tr::kQBytes + warp * Tr::kWarpRingBytes;
  const uint32_t a_ring = mma::SmemAddr(ring);
  float* s_m = reinterpret_cast<float*>(smem + Tr::kMainBytes);  // (warps, M)
  float* s_l = s_m + Tr::kWarps * kM;                             // (warps, M)
  float* s_row_m = s_l + Tr::kWarps * kM;                         // (M)
  float* s_row_l = s_row_m + kM;                                  // (M)
  int* s_last = reinterpret_cast<int*>(s_row_l + kM);

  // Benchmark only: the CTA's stamps (DecodeTraceStamp), by thread 0. The
  // pointer is read from the kernel's parameters at each stamp, so that it
  // holds no register through the kernel.
  auto stamp = [&](int at) {
    if (args.trace != nullptr && tid == 0) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      args.trace[blockIdx.x * kDecodeTraceWords + at] = t;
    }
  };
  stamp(kDecodeTraceStart);
  if (args.trace != nullptr && tid == 0) {
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    args.trace[blockIdx.x * kDecodeTraceWords + kDecodeTraceSm] = sm;
  }
  const DecodeWorkItem item = args.items[blockIdx.x];
  const PrefillSeq& seq = item.seq_info;
  const int H = args.p.geo.num_qo_heads;
  const int KVH = args.p.geo.num_kv_heads;
  const int group = H / KVH;
  const int kvh = item.kv_head;
  const int q_len = seq.q_len;

  // The keys the tile reads (kernels/variant.h: what its rows see, within
  // the item's chunk); steps inside [full_begin, full_end) need no mask.
  const int t_first = item.row_begin / group;
  const int t_last = min(q_len - 1, (item.row_begin + kM - 1) / group);
  const TileKeys tile_keys = RowsKeys(seq, t_first, t_last);
  const int kv_begin = item.kv_begin;
  const int kv_end = min(item.kv_end, tile_keys.read.end);
  const int full_begin = tile_keys.full.begin;
  const int full_end = min(item.kv_end, tile_keys.full.end);
  const int num_steps = kv_end > kv_begin ? (kv_end - kv_begin + Tr::kTok - 1) / Tr::kTok : 0;
  const int my_steps = num_steps > warp ? (num_steps - warp + Tr::kWarps - 1) / Tr::kWarps : 0;

  // ---- K/V addressing. A row of the pool (one slot, all KV heads) is
  // row_bytes long; kv_base is the item's layer and KV head plus the lane's
  // 16-byte chunk kv_c. In pass p of a step the lane copies that chunk of
  // row kv_r0 + p * kRowsPerPass (16-bit pools: kChunks chunks a row, FP8
  // pools kChunks8).
  constexpr int kElem = kFp8 ? 1 : static_cast<int>(sizeof(T));
  const int kv_c = kFp8 ? lane % Tr::kChunks8 : lane % Tr::kChunks;
  const int kv_r0 = kFp8 ? lane / Tr::kChunks8 : lane / Tr::kChunks;
  const uint32_t row_bytes = static_cast<uint32_t>(KVH) * D * kElem;
  const int64_t kv_base = static_cast<int64_t>(seq.layer) * args.slots_per_layer * row_bytes +
                          static_cast<int64_t>(kvh) * D * kElem + kv_c * 16;
  const uint8_t* const k_base = static_cast<const uint8_t*>(args.p.k_cache) + kv_base;
  const uint8_t* const v_base = static_cast<const uint8_t*>(args.p.v_cache) + kv_base;
  // Shared-memory offsets of the lane's chunk in pass p of a K and a V stage.
  // The swizzles repeat every kPeriod passes (SwzPeriod, traits.cuh), so
  // the lane keeps the first period's offsets and adds whole periods of rows
  // (immediates in the copies).
  constexpr int kPasses = kFp8 ? Tr::kPasses8 : Tr::kPasses;
  constexpr int kRowsPerPass = kFp8 ? Tr::kRowsPerPass8 : Tr::kRowsPerPass;
  constexpr int kPeriod =
      kFp8 ? SwzPeriod(kRowsPerPass, D, Tr::kChunks8, [](int r, int c) { return SwzK8<D>(r, c); },
                       [](int r, int c) { return SwzV8<D>(r, c); })
           : SwzPeriod(kRowsPerPass, Tr::kRowBytes, Tr::kChunks, [](int r, int c) { return Swz<Tr::kRowBytes>(r, c); });
  constexpr int kPeriodBytes = kPeriod * kRowsPerPass * (kFp8 ? D : Tr::kRowBytes);
  uint32_t k_off[kPeriod], v_off[kPeriod];
#pragma unroll
  for (int p = 0; p < kPeriod; ++p) {
    const int r = p * kRowsPerPass + kv_r0;
    k_off[p] = kFp8 ? SwzK8<D>(r, kv_c) : Swz<Tr::kRowBytes>(r, kv_c);
    v_off[p] = kFp8 ? SwzV8<D>(r, kv_c) : Swz<Tr::kRowBytes>(r, kv_c);
  }
  const int32_t* pages = args.p.kv_indices + seq.kv_start;
  const FastDiv page_div = args.page;
  const int page_size = page_div.d;

  // Lane l holds token (l & 15) of each step: position step_pos(i). Its
  // page-table index and row in the page are walked from step to step (a
  // step moves kAdv positions: adv_pages pages and adv_rows rows) instead
  // of divided by the page size at every step.
  auto step_pos = [&](int i) { return kv_begin + (i * Tr::kWarps + warp) * Tr::kTok + (lane & 15); };
  constexpr int kAdv = Tr::kWarps * Tr::kTok;
  const int adv_pages = page_div.Div(kAdv);
  const int adv_rows = kAdv - adv_pages * page_size;
  struct Walk {
    int index;  // into pages
    int row;    // in the page
  };
  // The walk at step i, from its position (the one division).
  auto walk_from = [&](int i) {
    const int pos = step_pos(i);
    const int q = page_div.Div(pos);
    return Walk{q, pos - q * page_size};
  };
  auto advance = [&](Walk& w) {
    w.index += adv_pages;
    w.row += adv_rows;
    if (w.row >= page_size) {
      w.row -= page_size;
      ++w.index;
    }
  };
  // The page of step i's token (-1: past the range); calls come in step
  // order, load_walk at step i.
  Walk load_walk = walk_from(0), issue_walk = load_walk;
  auto load_page = [&](int i) -> int {
    const int page = (i < my_steps && step_pos(i) < kv_end) ? __ldg(pages + load_walk.index) : -1;
    advance(load_walk);
    return page;
  };
  // The step's 16 rows: lane l < 16 computes the slot of token l (its row in
  // the layer, -1 past the range; PagedDecodeCuda checks that a layer's
  // slots fit 31 bits), and each lane takes the slots of the rows it copies
  // from their lanes. Rows past the range are zero-filled. Calls come in
  // step order (issue_walk at step i).
  auto issue = [&](int i, int page) {
    const int slot = page >= 0 ? page * page_size + issue_walk.row : -1;
    advance(issue_walk);
    const uint32_t k_st = a_ring + (i % kStages) * 2 * kStageBytes;
    const uint32_t v_st = k_st + kStageBytes;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int sl = __shfl_sync(0xffffffffu, slot, p * kRowsPerPass + kv_r0);
      const uint64_t src = static_cast<uint64_t>(static_cast<uint32_t>(max(sl, 0))) * row_bytes;
      const uint32_t period = (p / kPeriod) * kPeriodBytes;
      mma::CpAsync16UnlessNegative(k_st + k_off[p % kPeriod] + period, k_base + src, sl);
      mma::CpAsync16UnlessNegative(v_st + v_off[p % kPeriod] + period, v_base + src, sl);
    }
  };

  // ---- Prologue: the first kStages - kNs steps in flight, then Q. The
  // page entries of all of them and of the first iteration's issues are
  // loaded at once (independent loads: one memory round trip before the
  // first K/V request, not one per step).
  int pages_ahead[kStages];
#pragma unroll
  for (int s = 0; s < kStages; ++s) pages_ahead[s] = load_page(s);
#pragma unroll
  for (int s = 0; s < kStages - kNs; ++s) {
    if (s < my_steps) issue(s, pages_ahead[s]);
    mma::CpAsyncCommit();
  }
  int page_next[kNs];
#pragma unroll
  for (int k = 0; k < kNs; ++k) page_next[k] = pages_ahead[kStages - kNs + k];

  // Q tile: packed row r -> token r / group, head kvh * group + r % group.
  // bf16 queries over an FP8 pool are stored as fp16 times 2^q_exp (kQHalf:
  // S = Q K^T then runs in fp16, where K takes the hardware's conversion).
  constexpr int kQPer = kM * Tr::kChunks / Tr::kThreads;  // 16-byte chunks per thread
  static_assert(kQPer * Tr::kThreads == kM * Tr::kChunks, "Q chunks");
  uint4 qv[kQPer];
#pragma unroll
  for (int k = 0; k < kQPer; ++k) {
    const int idx = tid + k * Tr::kThreads;
    const int r = idx / Tr::kChunks;
    const int c = idx % Tr::kChunks;
    const int pr = item.row_begin + r;
    const int t = pr / group;
    qv[k] = make_uint4(0, 0, 0, 0);
    if (t < q_len) {
      const int head = kvh * group + (pr - t * group);
      const T* q_row = static_cast<const T*>(args.p.q) + (static_cast<int64_t>(seq.q_start + t) * H + head) * D;
      if constexpr (kFp8) {  // logical chunk c: pairs at (c / 2) * 4 + (c % 2) * 2 + j * D/4
        const uint32_t* w = reinterpret_cast<const uint32_t*>(q_row + (c >> 1) * 4 + (c & 1) * 2);
        constexpr int kQuarter = D / 8;  // D/4 elements in uint32 pairs
        qv[k] = make_uint4(__ldg(w), __ldg(w + kQuarter), __ldg(w + 2 * kQuarter), __ldg(w + 3 * kQuarter));
      } else {
        qv[k] = __ldg(reinterpret_cast<const uint4*>(q_row + c * 8));
      }
    }
  }
  // kQHalf: each row's exponent (QHalfExponent of its largest finite |q|;
  // the kChunks lanes of a row are consecutive lanes of one warp), kept in
  // s_row_m (free until the epilogue) for the rows' logit transforms.
  int* const s_q_exp = reinterpret_cast<int*>(s_row_m);
  if constexpr (kQHalf) {
#pragma unroll
    for (int k = 0; k < kQPer; ++k) {
      uint32_t w[4] = {qv[k].x, qv[k].y, qv[k].z, qv[k].w};
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = Unpack2<T>(w[j]);
        amax = fmaxf(amax, fmaxf(FiniteAbs(f.x), FiniteAbs(f.y)));
      }
#pragma unroll
      for (int o = Tr::kChunks / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const int e = QHalfExponent(amax);
      const float q_mul = ldexpf(1.f, e);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = Unpack2<T>(w[j]);
        w[j] = Pack2<__half>(f.x * q_mul, f.y * q_mul);
      }
      qv[k] = make_uint4(w[0], w[1], w[2], w[3]);
      const int idx = tid + k * Tr::kThreads;
      if (idx % Tr::kChunks == 0) s_q_exp[idx / Tr::kChunks] = e;
    }
  }
#pragma unroll
  for (int k = 0; k < kQPer; ++k) {
    const int idx = tid + k * Tr::kThreads;
    *reinterpret_cast<uint4*>(s_q + Swz<Tr::kRowBytes>(idx / Tr::kChunks, idx % Tr::kChunks)) = qv[k];
  }
  __syncthreads();

  // Thread holds rows lane / 4 (h = 0) and lane / 4 + 8 (h = 1) of each m-tile;
  // KV positions in [lo, hi)[mt][h] are visible to them.
  int lo[MT][2], hi[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const KeyRange sees = RowKeys(seq, (item.row_begin + mt * 16 + (lane >> 2) + h * 8) / group);
      lo[mt][h] = sees.begin;
      hi[mt][h] = min(sees.end, item.kv_end);
    }
  }
  // The scale keeps its sign here (it is applied before the row maximum).
  // FP8: K's and V's scales of this layer and KV head (1 when none are set).
  float k_scale = 1.f, v_scale = 1.f;
  if (kFp8) {
    k_scale = KvScaleAt(args.p.k_scales, seq.layer, KVH, kvh);
    v_scale = KvScaleAt(args.p.v_scales, seq.layer, KVH, kvh);
  }
  // Each row's logit transform, with K's scale and, kQHalf, 2^-(the row's
  // exponent) that its fp16 Q carries.
  LogitTransform logit[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float q_scale = kQHalf ? ldexpf(1.f, -s_q_exp[mt * 16 + (lane >> 2) + h * 8]) : 1.f;
      logit[mt][h] = LogitTransform::Of(seq, /*positive_scale=*/false, k_scale * q_scale);
    }
  }
  float o_acc[MT][D / 8][4];
  float m_run[MT][2];
  float l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[mt][n][e] = 0.f;
    }
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.f;
  }

  // ---- Main loop over this warp's steps, kNs at a time. A step's work:
  // score (S = Q K^T of its stage, scaled or soft-capped, masked on
  // boundary steps, into s), then the online softmax over the iteration's
  // steps, then pv (O += P V of its stage).
  // S = Q K^T: s[mt][n] covers tokens n * 8 .. n * 8 + 7 of step i.
  auto score = [&](int i, float (&s)[MT][2][4]) {
    [[maybe_unused]] const uint32_t k_st = a_ring + (i % kStages) * 2 * kStageBytes;  // 16-bit pools
    [[maybe_unused]] const uint8_t* const k_st8 = ring + (i % kStages) * 2 * kStageBytes;  // FP8 pools
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
      }
    }
    if constexpr (kFp8) {
      // Thread (g, c) holds tokens g and g + 8 of the step, physical
      // dimensions c * D/4 + kk * 4 + 0..3 for block kk (b0: 0, 1; b1: 2, 3).
      constexpr int kJ = D / 64;  // 16-byte chunks of a K row per thread
      const int g = lane >> 2, c = lane & 3;
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const uint4 k0 = *reinterpret_cast<const uint4*>(k_st8 + SwzK8<D>(g, c * kJ + j));
        const uint4 k1 = *reinterpret_cast<const uint4*>(k_st8 + SwzK8<D>(g + 8, c * kJ + j));
        const uint32_t w0[4] = {k0.x, k0.y, k0.z, k0.w};
        const uint32_t w1[4] = {k1.x, k1.y, k1.z, k1.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const int kk = j * 4 + w;
          uint32_t b0[2], b1[2];
          Fp8x4ToHalf<F8>(w0[w], b0[0], b0[1]);
          Fp8x4ToHalf<F8>(w1[w], b1[0], b1[1]);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            uint32_t qa[4];
            mma::LdMatrixX4(qa, a_q + Swz<Tr::kRowBytes>(mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
            mma::Mma16816<TS>(s[mt][0], qa, b0[0], b0[1]);
            mma::Mma16816<TS>(s[mt][1], qa, b1[0], b1[1]);
          }
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < (kFp8 ? 0 : D / 16); ++kk) {
      uint32_t kb[4];
      mma::LdMatrixX4(kb, k_st + Swz<Tr::kRowBytes>(((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t qa[4];
        mma::LdMatrixX4(qa, a_q + Swz<Tr::kRowBytes>(mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
        mma::Mma16816<T>(s[mt][0], qa, kb[0], kb[1]);
        mma::Mma16816<T>(s[mt][1], qa, kb[2], kb[3]);
      }
    }

    // Scale (soft-capped or not), mask (boundary steps only): whether a step
    // caps and masks is decided once for the warp, not per logit.
    const int step_start = kv_begin + (i * Tr::kWarps + warp) * Tr::kTok;
    const bool need_mask = step_start < full_begin || step_start + Tr::kTok > full_end;
    auto to_log2 = [&](auto capped, auto masked) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float d = s[mt][n][2 * h + e];
              float x;
              if constexpr (decltype(capped)::value) {
                x = logit[mt][h].cap * SoftCapTanh(d * logit[mt][h].mul);
              } else {
                x = d * logit[mt][h].mul;
              }
              if constexpr (decltype(masked)::value) {
                const int pos = step_start + n * 8 + (lane & 3) * 2 + e;
                x = (pos < lo[mt][h] || pos >= hi[mt][h]) ? -INFINITY : x;
              }
              s[mt][n][2 * h + e] = x;
            }
          }
        }
      }
    };
    if (logit[0][0].capped()) {
      if (need_mask) {
        to_log2(std::true_type{}, std::true_type{});
      } else {
        to_log2(std::true_type{}, std::false_type{});
      }
    } else if (need_mask) {
      to_log2(std::false_type{}, std::true_type{});
    } else {
      to_log2(std::false_type{}, std::false_type{});
    }
  };

  // O += P V: P is one 16x16 A fragment per m-tile (fp16 for FP8 pools).
  using TP = typename std::conditional<kFp8, __half, T>::type;
  auto pv = [&](int i, const uint32_t (&pa)[MT][4]) {
    [[maybe_unused]] const uint32_t v_st = a_ring + (i % kStages) * 2 * kStageBytes + kStageBytes;
    [[maybe_unused]] const uint8_t* const v_st8 = ring + (i % kStages) * 2 * kStageBytes + kStageBytes;
    if constexpr (kFp8) {
      // Thread (g, c) reads bytes g * D/8 .. of tokens 2c, 2c + 1 (b0) and
      // 2c + 8, 2c + 9 (b1); byte nt of them is n-tile nt's column g.
      constexpr int kVB = D / 8;
      const int g = lane >> 2, c = lane & 3;
      auto pv4 = [&](int nt0, uint32_t x0, uint32_t x1, uint32_t x8, uint32_t x9) {
        uint32_t lo[4], hi[4];  // n-tiles nt0 .. nt0 + 3: (lo[k], hi[k]) their b0, b1
        Fp8x4ToHalf<F8>(__byte_perm(x0, x1, 0x5140), lo[0], lo[1]);
        Fp8x4ToHalf<F8>(__byte_perm(x0, x1, 0x7362), lo[2], lo[3]);
        Fp8x4ToHalf<F8>(__byte_perm(x8, x9, 0x5140), hi[0], hi[1]);
        Fp8x4ToHalf<F8>(__byte_perm(x8, x9, 0x7362), hi[2], hi[3]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma::Mma16816<__half>(o_acc[mt][nt0 + k], pa[mt], lo[k], hi[k]);
        }
      };
      if constexpr (kVB == 8) {  // head_dim 64: half a chunk per row
        uint2 x[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int r = 2 * c + (q & 1) + (q >> 1) * 8;
          x[q] = *reinterpret_cast<const uint2*>(v_st8 + SwzV8<D>(r, g >> 1) + (g & 1) * 8);
        }
        pv4(0, x[0].x, x[1].x, x[2].x, x[3].x);
        pv4(4, x[0].y, x[1].y, x[2].y, x[3].y);
      } else {
#pragma unroll
        for (int h = 0; h < kVB / 16; ++h) {
          uint4 x[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int r = 2 * c + (q & 1) + (q >> 1) * 8;
            x[q] = *reinterpret_cast<const uint4*>(v_st8 + SwzV8<D>(r, g * (kVB / 16) + h));
          }
          pv4(h * 16 + 0, x[0].x, x[1].x, x[2].x, x[3].x);
          pv4(h * 16 + 4, x[0].y, x[1].y, x[2].y, x[3].y);
          pv4(h * 16 + 8, x[0].z, x[1].z, x[2].z, x[3].z);
          pv4(h * 16 + 12, x[0].w, x[1].w, x[2].w, x[3].w);
        }
      }
    }
#pragma unroll
    for (int dp = 0; dp < (kFp8 ? 0 : D / 16); ++dp) {
      uint32_t vb[4];
      mma::LdMatrixX4Trans(vb, v_st + Swz<Tr::kRowBytes>(((lane >> 3) & 1) * 8 + (lane & 7), dp * 2 + (lane >> 4)));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma::Mma16816<T>(o_acc[mt][2 * dp], pa[mt], vb[0], vb[1]);
        mma::Mma16816<T>(o_acc[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
      }
    }
  };

  for (int i = 0; i < my_steps; i += kNs) {
#pragma unroll
    for (int k = 0; k < kNs; ++k) {
      const int ahead = i + kStages - kNs + k;
      if (ahead < my_steps) issue(ahead, page_next[k]);
      mma::CpAsyncCommit();
    }
#pragma unroll
    for (int k = 0; k < kNs; ++k) page_next[k] = load_page(i + kStages + k);  // used next iteration
    mma::CpAsyncWait<kStages - kNs>();
    __syncwarp();
    // The iteration's steps (k > 0: none past the warp's last step; uniform
    // over the warp).
    bool has[kNs];
#pragma unroll
    for (int k = 0; k < kNs; ++k) has[k] = k == 0 || i + k < my_steps;
    float s[kNs][MT][2][4];
#pragma unroll
    for (int k = 0; k < kNs; ++k) {
      if (has[k]) {
        score(i + k, s[k]);
      } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[k][mt][n][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax in base 2, with a lazy maximum: a row's running
    // maximum m_run moves only when some row of the warp sees a logit more
    // than kLazyMax above its own (then every row of the warp takes its new
    // maximum and O is rescaled); otherwise the rows keep theirs, P stays
    // below 2^kLazyMax, and O is not touched. The result is the same: O and l
    // are always relative to the same m_run.
    constexpr float kLazyMax = 8.f;
    float mx[MT][2];
    bool grow = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        auto max4 = [&](int k) {
          return fmaxf(fmaxf(s[k][mt][0][2 * h], s[k][mt][0][2 * h + 1]),
                       fmaxf(s[k][mt][1][2 * h], s[k][mt][1][2 * h + 1]));
        };
        float x = max4(0);
#pragma unroll
        for (int k = 1; k < kNs; ++k) x = fmaxf(x, max4(k));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
        mx[mt][h] = x;
        grow |= x > m_run[mt][h] + kLazyMax;  // -inf + 8: any finite logit
      }
    }
    grow = __any_sync(0xffffffffu, grow);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float alpha = 1.f;
        if (grow) {
          const float m_new = fmaxf(m_run[mt][h], mx[mt][h]);
          alpha = m_new == m_run[mt][h] ? 1.f : Exp2(m_run[mt][h] - m_new);  // 0 from -inf
          m_run[mt][h] = m_new;
#pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            o_acc[mt][n][2 * h] *= alpha;
            o_acc[mt][n][2 * h + 1] *= alpha;
          }
        }
        const float m_use = m_run[mt][h] == -INFINITY ? 0.f : m_run[mt][h];
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < kNs; ++k) {
#pragma unroll
          for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p = Exp2(s[k][mt][n][2 * h + e] - m_use);
              s[k][mt][n][2 * h + e] = p;
              sum += p;
            }
          }
        }
        l_run[mt][h] = l_run[mt][h] * alpha + sum;
      }
    }

#pragma unroll
    for (int k = 0; k < kNs; ++k) {
      if (!has[k]) continue;
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = Pack2<TP>(s[k][mt][0][0], s[k][mt][0][1]);
        pa[mt][1] = Pack2<TP>(s[k][mt][0][2], s[k][mt][0][3]);
        pa[mt][2] = Pack2<TP>(s[k][mt][1][0], s[k][mt][1][1]);
        pa[mt][3] = Pack2<TP>(s[k][mt][1][2], s[k][mt][1][3]);
      }
      pv(i + k, pa);
    }
    __syncwarp();  // the next iteration refills the stages before these
  }
  mma::CpAsyncWait<0>();
  stamp(kDecodeTraceStreamed);  // thread 0's warp: the CTA's other warps may still compute

  // ---- Combine the 4 warps: row max / sum, then each warp's O scaled by
  // 2^(m_w - m) / l into shared memory (over Q and the rings: barrier first).
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[mt][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if ((lane & 3) == 0) {
        const int r = mt * 16 + (lane >> 2) + h * 8;
        s_m[warp * kM + r] = m_run[mt][h];
        s_l[warp * kM + r] = l;
      }
    }
  }
  __syncthreads();
  // Each row's end (kernels/variant.h, EndRow; the item of chunk 0 carries
  // the rows' sinks): s_row_m its max, s_row_l the factor of its O, and its
  // base-2 LSE in s_l[row] (the thread has read that slot's warp sums).
  if (tid < kM) {
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) m = fmaxf(m, s_m[w * kM + tid]);
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float mw = s_m[w * kM + tid];
      if (mw != -INFINITY) l += s_l[w * kM + tid] * Exp2(mw - m);
    }
    float sink2 = -INFINITY;
    const int pr = item.row_begin + tid;
    const int t = pr / group;
    if (seq.sink_index >= 0 && item.chunk == 0 && t < q_len) {
      sink2 = __ldg(args.p.sinks + static_cast<int64_t>(seq.sink_index) * H + kvh * group + (pr - t * group)) *
              kLog2e;
    }
    const RowEnd end = EndRow(m, l, sink2);
    s_row_m[tid] = m;
    s_row_l[tid] = end.o_scale;
    s_l[tid] = end.lse2;
  }
  __syncthreads();
  float* s_o = reinterpret_cast<float*>(smem);  // (warps, M, kOStride)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + (lane >> 2) + h * 8;
      const float f =
          m_run[mt][h] != -INFINITY ? Exp2(m_run[mt][h] - s_row_m[r]) * s_row_l[r] * v_scale : 0.f;
      if constexpr (kFp8) {  // column e of n-tile n is dimension e * D/8 + n
        float* dst = s_o + (warp * kM + r) * Tr::kOStride + (lane & 3) * 2 * (D / 8);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          dst[n] = o_acc[mt][n][2 * h] * f;
          dst[D / 8 + n] = o_acc[mt][n][2 * h + 1] * f;
        }
      } else {
        float* dst = s_o + (warp * kM + r) * Tr::kOStride + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o_acc[mt][n][2 * h] * f, o_acc[mt][n][2 * h + 1] * f);
        }
      }
    }
  }
  __syncthreads();
  const TileOut<D, Tr, T> out{args, item, smem, s_l, s_row_m, s_last, tid, warp, lane, group};
  if (args.cluster > 1) {
    MergeCluster(out);
  } else if (item.split_tile < 0) {
    WriteRows(out);
  } else {
    WritePartial(out);
    stamp(kDecodeTraceEnd);
    if (args.skip_merge || !LastChunk(out)) return;
    MergePartials(out);
    return;
  }
  stamp(kDecodeTraceEnd);
}

}  // namespace decode
}  // namespace attnserve
