// The sm80 paged prefill kernel, FlashAttention-2 style on mma.sync: 4 warps
// per CTA, each warp owns 16 * MT packed query rows; K/V stream in blocks of
// KB tokens through double-buffered cp.async into XOR-swizzled shared memory;
// online softmax in base 2 with the scale folded in; O stays in registers.
//
// Phases, in order: the Q tile and the first K/V block are issued (cp.async);
// the main loop runs S = Q K^T, the boundary mask, the lazy online softmax and
// O += P V per block while the next block loads; the epilogue normalises and
// writes either the final o / lse or, for a split item, an fp32 partial state
// for the merge family. They stay in one function: the phases share the
// per-row state in registers, and splitting them would only move names around.
//
// FP8 pools (kFp8, Traits): K and V rows land as stored (D bytes a row) in
// raw stages, and the CTA rewrites each landed block as the fp16 tiles the
// MMAs read (ConvertFp8Block: exact for both formats) just before its MMAs.
// Both MMAs run in fp16 whatever the queries are, as in the decode family:
// bf16 queries are carried into fp16 per row as the Q tile is loaded,
// through registers (QHalfExponent, kernels/fp8_device.cuh: the row's
// largest finite |q| in [2^14, 2^15), the row's logit scale takes the power
// back; a negative scale's sign joins the factor), K's scale joins the
// logit scale and V's the output factor.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/fp8.h"
#include "kernels/fp8_device.cuh"
#include "kernels/math.h"
#include "kernels/sm80/mma.cuh"
#include "kernels/sm80/traits.cuh"
#include "kernels/variant.h"

namespace attnserve {
namespace sm80 {

// kFp8: a landed block's FP8 rows (raw: KB rows of D bytes, dense) as the
// fp16 tile (Swz rows of D * 2 bytes) at tile, by the CTA's 128 threads:
// each 16-byte chunk of FP8 becomes two chunks of fp16 (exact). A warp's
// reads and writes each take the fewest wavefronts their bytes allow.
template <int D, int KB, int F8>
__device__ __forceinline__ void ConvertFp8Block(const uint8_t* raw, uint8_t* tile, int tid) {
  constexpr int kChunks8 = D / 16;
  constexpr int kPer = KB * kChunks8 / 128;
  static_assert(kPer * 128 == KB * kChunks8, "whole chunks per thread");
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int i = tid + k * 128;
    const int r = i / kChunks8;
    const int c = i % kChunks8;
    const uint4 v = *reinterpret_cast<const uint4*>(raw + i * 16);
    uint32_t h[8];
    Fp8x4ToHalfRegs<F8>(v.x, h[0], h[1]);
    Fp8x4ToHalfRegs<F8>(v.y, h[2], h[3]);
    Fp8x4ToHalfRegs<F8>(v.z, h[4], h[5]);
    Fp8x4ToHalfRegs<F8>(v.w, h[6], h[7]);
    *reinterpret_cast<uint4*>(tile + Swz<D * 2>(r, 2 * c)) = make_uint4(h[0], h[1], h[2], h[3]);
    *reinterpret_cast<uint4*>(tile + Swz<D * 2>(r, 2 * c + 1)) = make_uint4(h[4], h[5], h[6], h[7]);
  }
}

// One CTA per work item. The scale is folded into the exponent's FFMA and the
// O rescale is skipped while no row's max grows by more than kLazyRescale
// (see the softmax). kFp8: the caches hold FP8 bytes (Traits).
template <int D, int MT, int KB, typename T, bool kFp8 = false>
__global__ void __launch_bounds__(128, 2)
    PagedPrefillKernel(const PrefillKernelArgs args) {
  using Tr = Traits<D, MT, KB, kFp8>;
  using TG = std::conditional_t<kFp8, __half, T>;  // the MMAs' operands
  constexpr bool kQToHalf = kFp8 && std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_q = smem;
  uint8_t* s_k = smem + Tr::kKOff;                 // Tr::kKvStages stages
  uint8_t* s_v = smem + Tr::kVOff;                 // Tr::kKvStages stages
  // Element offsets of the K/V rows of the next two blocks (-1: past the end),
  // computed one block ahead so no page-table load sits on the issue path.
  int64_t* s_off = reinterpret_cast<int64_t*>(smem + Tr::kOffOff);
  const uint32_t a_q = mma::SmemAddr(s_q);
  const uint32_t a_k = mma::SmemAddr(s_k);
  const uint32_t a_v = mma::SmemAddr(s_v);
  // kFp8: the raw stages, and each Q row's exponent (kQToHalf; 0 otherwise).
  [[maybe_unused]] uint8_t* s_rk = smem + Tr::kRawKOff;
  [[maybe_unused]] uint8_t* s_rv = smem + Tr::kRawVOff;
  [[maybe_unused]] int* s_qexp = reinterpret_cast<int*>(smem + Tr::kQExpOff);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;

  const PrefillWorkItem item = args.items[blockIdx.x];
  const PrefillSeq seq = args.p.seqs[item.seq];
  const int H = args.p.geo.num_qo_heads;
  const int KVH = args.p.geo.num_kv_heads;
  const int group = H / KVH;
  const int kvh = item.kv_head;
  const int q_len = seq.q_len;

  // The keys the tile reads (kernels/variant.h: what its rows see, within
  // the item's chunk) and those every row sees: blocks inside
  // [full_begin, full_end) need no per-element mask.
  const int t_first = item.row_begin / group;
  const int t_last = min(q_len - 1, (item.row_begin + Tr::kM - 1) / group);
  const TileKeys tile_keys = RowsKeys(seq, t_first, t_last);
  const int kv_begin = item.kv_begin;
  const int kv_end = min(item.kv_end, tile_keys.read.end);
  const int full_begin = tile_keys.full.begin;
  const int full_end = min(item.kv_end, tile_keys.full.end);
  const int num_blocks = kv_end > kv_begin ? (kv_end - kv_begin + KB - 1) / KB : 0;

  // ---- Q tile: packed row r -> token r / group, head kvh * group + r % group.
  // (kQToHalf: through registers, converted, after block 0's copies.)
  const T* q = static_cast<const T*>(args.p.q);
  if constexpr (!kQToHalf) {
    const int c = tid % Tr::kChunks;
#pragma unroll
    for (int p = 0; p < Tr::kQPasses; ++p) {
      const int r = p * Tr::kRowsPerPass + tid / Tr::kChunks;
      const int pr = item.row_begin + r;
      const int t = pr / group;
      const int g = pr - t * group;
      const bool valid = t < q_len;
      const T* src = valid ? q + ((int64_t)(seq.q_start + t) * H + kvh * group + g) * D + c * 8 : q;
      mma::CpAsync16(a_q + Swz<Tr::kRowBytes>(r, c), src, valid);
    }
  }

  // ---- K/V addressing: each thread loads chunk c of kKvPasses rows per block.
  const int kv_c = tid % Tr::kChunks;
  const int kv_r0 = tid / Tr::kChunks;
  const int64_t row_stride = (int64_t)KVH * D;
  const int64_t kv_base = (int64_t)seq.layer * args.slots_per_layer * row_stride + kvh * D + kv_c * 8;
  const T* k_base = static_cast<const T*>(args.p.k_cache) + kv_base;
  const T* v_base = static_cast<const T*>(args.p.v_cache) + kv_base;
  // kFp8: one byte an element (a row's element offset is its byte offset),
  // chunk kv_c8 of rows kv_r8 + kRowsPerPass8 * p.
  const int kv_c8 = tid % Tr::kChunks8;
  const int kv_r8 = tid / Tr::kChunks8;
  const int64_t kv_base8 = (int64_t)seq.layer * args.slots_per_layer * row_stride + kvh * D + kv_c8 * 16;
  [[maybe_unused]] const uint8_t* k_base8 = static_cast<const uint8_t*>(args.p.k_cache) + kv_base8;
  [[maybe_unused]] const uint8_t* v_base8 = static_cast<const uint8_t*>(args.p.v_cache) + kv_base8;
  const int32_t* pages = args.p.kv_indices + seq.kv_start;
  const int ps = args.p.geo.page_size;

  // Row offsets of block `block` into s_off[block & 1]; called by every
  // thread, rows strided by the CTA size.
  auto page_offset = [&](int block, int row) -> int64_t {
    const int pos = kv_begin + block * KB + row;
    if (pos >= kv_end) return -1;
    const int page = __ldg(pages + pos / ps);
    return ((int64_t)page * ps + pos % ps) * row_stride;
  };
  auto issue_kv = [&](int block) {
    const int stage = block & 1;
    const int64_t* offs = s_off + stage * KB;
    if constexpr (kFp8) {
      const uint32_t a_rk = mma::SmemAddr(s_rk) + stage * Tr::kRawBytes;
      const uint32_t a_rv = mma::SmemAddr(s_rv) + stage * Tr::kRawBytes;
#pragma unroll
      for (int p = 0; p < Tr::kKvPasses8; ++p) {
        const int r = p * Tr::kRowsPerPass8 + kv_r8;
        const int64_t o = offs[r];
        const bool valid = o >= 0;
        const int64_t off = valid ? o : 0;
        const uint32_t so = r * D + kv_c8 * 16;
        mma::CpAsync16(a_rk + so, k_base8 + off, valid);
        mma::CpAsync16(a_rv + so, v_base8 + off, valid);
      }
      return;
    }
    // (Unreachable in the kFp8 kernels, which returned above: nvcc's
    // warning 128 says so for each of them.)
#pragma nv_diag_suppress 128
#pragma unroll
    for (int p = 0; p < Tr::kKvPasses; ++p) {
      const int r = p * Tr::kRowsPerPass + kv_r0;
      const int64_t o = offs[r];
      const bool valid = o >= 0;
      const int64_t off = valid ? o : 0;
      const uint32_t so = stage * Tr::kKvBytes + Swz<Tr::kRowBytes>(r, kv_c);
      mma::CpAsync16(a_k + so, k_base + off, valid);
      mma::CpAsync16(a_v + so, v_base + off, valid);
    }
#pragma nv_diag_default 128
  };

  for (int r = tid; r < 2 * KB; r += Tr::kThreads) {
    s_off[r] = r < KB ? page_offset(0, r) : page_offset(1, r - KB);
  }
  __syncthreads();
  if (num_blocks > 0) issue_kv(0);
  mma::CpAsyncCommit();
  if constexpr (kQToHalf) {
    // bf16 queries over FP8 pools: each row as fp16 times 2^e (QHalfExponent
    // of its largest finite |q|, over the kChunks consecutive lanes that
    // hold it), a negative scale's sign folded in; e beside the tile, for
    // the rows' logit transforms (row_logit). Every chunk is loaded, then
    // every row's maximum reduced, so that each step's latency is paid once;
    // the main loop's first barrier publishes the tile.
    constexpr int kQPer = Tr::kM * Tr::kChunks / Tr::kThreads;
    static_assert(kQPer * Tr::kThreads == Tr::kM * Tr::kChunks && 32 % Tr::kChunks == 0, "Q chunks");
    uint4 qv[kQPer];
    float amax[kQPer];
#pragma unroll
    for (int k = 0; k < kQPer; ++k) {
      const int idx = tid + k * Tr::kThreads;
      const int pr = item.row_begin + idx / Tr::kChunks;
      const int t = pr / group;
      qv[k] = make_uint4(0u, 0u, 0u, 0u);
      if (t < q_len) {
        const T* src = q + ((int64_t)(seq.q_start + t) * H + kvh * group + (pr - t * group)) * D + (idx % Tr::kChunks) * 8;
        qv[k] = __ldg(reinterpret_cast<const uint4*>(src));
      }
    }
#pragma unroll
    for (int k = 0; k < kQPer; ++k) {
      const uint32_t w[4] = {qv[k].x, qv[k].y, qv[k].z, qv[k].w};
      amax[k] = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = Unpack2<T>(w[j]);
        amax[k] = fmaxf(amax[k], fmaxf(FiniteAbs(f.x), FiniteAbs(f.y)));
      }
    }
#pragma unroll
    for (int o = Tr::kChunks / 2; o > 0; o >>= 1) {
#pragma unroll
      for (int k = 0; k < kQPer; ++k) amax[k] = fmaxf(amax[k], __shfl_xor_sync(0xffffffffu, amax[k], o));
    }
#pragma unroll
    for (int k = 0; k < kQPer; ++k) {
      const int idx = tid + k * Tr::kThreads;
      const int r = idx / Tr::kChunks;
      const int c = idx % Tr::kChunks;
      const int e = QHalfExponent(amax[k]);
      const float q_mul = seq.sm_scale < 0.f ? -ldexpf(1.f, e) : ldexpf(1.f, e);
      uint32_t w[4] = {qv[k].x, qv[k].y, qv[k].z, qv[k].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = Unpack2<T>(w[j]);
        w[j] = Pack2<__half>(f.x * q_mul, f.y * q_mul);
      }
      *reinterpret_cast<uint4*>(s_q + Swz<Tr::kRowBytes>(r, c)) = make_uint4(w[0], w[1], w[2], w[3]);
      if (c == 0) s_qexp[r] = e;
    }
  }

  // ---- Per-row state. Thread holds rows lane/4 (h = 0) and lane/4 + 8 (h = 1)
  // of each of its MT m-tiles.
  const int warp_row0 = warp * 16 * MT;
  // The keys [begin, end) the thread's row (mt, h) sees in this item;
  // recomputed on boundary blocks only, to keep registers for the tiles.
  const int item_kv_end = item.kv_end;
  const int row_base = item.row_begin + warp_row0 + (lane >> 2);
  const int diag = seq.kv_len - q_len + seq.causal_shift;  // row t is at key position t + diag
  auto row_keys = [&](int mt, int h) {
    return RowKeysAt((row_base + mt * 16 + h * 8) / group + diag, seq.window_left, seq.causal != 0,
                     item_kv_end);
  };
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
  // The softmax takes row maxima on raw logits, so it needs a positive scale: a
  // negative one is moved into Q (sign flip in shared memory, once), and a
  // zero one becomes 1e-30 (every logit rounds to 0 either way, while masked
  // logits stay -inf instead of -inf * 0). A soft-capped sequence takes the
  // transform's other branch (uniform over the CTA).
  const bool negate_q = seq.sm_scale < 0.f;
  // kFp8: K's scale joins the logit scale (V's the output factor).
  [[maybe_unused]] float k_scale = 1.f, v_scale = 1.f;
  if constexpr (kFp8) {
    k_scale = KvScaleAt(args.p.k_scales, seq.layer, KVH, kvh);
    v_scale = KvScaleAt(args.p.v_scales, seq.layer, KVH, kvh);
  }
  const LogitTransform logit = LogitTransform::Of(seq, /*positive_scale=*/true, k_scale);
  // Row (mt, h)'s transform: kQToHalf, the multiplier takes back the 2^e its
  // fp16 Q carries (e from shared memory at each use, |e| <= 100, so 2^-e is
  // a normal float: no registers held across the main loop).
  auto row_logit = [&](int mt, int h) {
    if constexpr (kQToHalf) {
      return logit.TimesPow2(__int_as_float((127 - s_qexp[warp_row0 + mt * 16 + (lane >> 2) + h * 8]) << 23));
    }
    return logit;
  };
  [[maybe_unused]] const bool e5m2 = args.p.geo.kv_fp8 == Fp8Format::kE5m2;

  uint32_t q_frag[Tr::kQInRegs ? D / 16 : 1][4];

  // Warps whose rows are all past the sequence (decode tiles) skip the math.
  const bool warp_active = (item.row_begin + warp_row0) / group < q_len;

  for (int b = 0; b < num_blocks; ++b) {
    const int stage = b & 1;
    if (b + 1 < num_blocks) {
      issue_kv(b + 1);
      mma::CpAsyncCommit();
      mma::CpAsyncWait<1>();
    } else {
      mma::CpAsyncWait<0>();
    }
    __syncthreads();
    // Page offsets of block b + 2 (into the slot block b used); loaded now,
    // stored after the math so the load latency hides behind it.
    const bool next_offs = b + 2 < num_blocks && tid < KB;
    const int64_t off_next = next_offs ? page_offset(b + 2, tid) : 0;
    if (!kQToHalf && negate_q && b == 0) {  // the Q tile landed with block 0
#pragma unroll
      for (int i = tid; i < Tr::kQBytes / 16; i += Tr::kThreads) {
        uint4* p = reinterpret_cast<uint4*>(s_q) + i;
        uint4 v = *p;
        v.x ^= 0x80008000u; v.y ^= 0x80008000u; v.z ^= 0x80008000u; v.w ^= 0x80008000u;
        *p = v;
      }
      __syncthreads();
    }
    if constexpr (kFp8) {
      // Block b's FP8 rows (raw stage b & 1) as the fp16 tiles, by every
      // thread (rows of every warp).
      const int raw = stage * Tr::kRawBytes;
      if (e5m2) {
        ConvertFp8Block<D, KB, static_cast<int>(Fp8Format::kE5m2)>(s_rk + raw, s_k, tid);
        ConvertFp8Block<D, KB, static_cast<int>(Fp8Format::kE5m2)>(s_rv + raw, s_v, tid);
      } else {
        ConvertFp8Block<D, KB, static_cast<int>(Fp8Format::kE4m3)>(s_rk + raw, s_k, tid);
        ConvertFp8Block<D, KB, static_cast<int>(Fp8Format::kE4m3)>(s_rv + raw, s_v, tid);
      }
      __syncthreads();
    }
    if (!warp_active) {
      if (next_offs) s_off[(b & 1) * KB + tid] = off_next;
      __syncthreads();
      continue;
    }

    if constexpr (Tr::kQInRegs) {
      if (b == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          mma::LdMatrixX4(q_frag[kk], a_q + Swz<Tr::kRowBytes>(warp_row0 + (lane & 15), kk * 2 + (lane >> 4)));
        }
      }
    }

    // ---- S = Q K^T (fp32).
    float s[MT][KB / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < KB / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
      }
    }
    const uint32_t k_stage = a_k + (kFp8 ? 0 : stage) * Tr::kKvBytes;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[MT][4];
      if constexpr (Tr::kQInRegs) {
#pragma unroll
        for (int i = 0; i < 4; ++i) qa[0][i] = q_frag[kk][i];
      } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::LdMatrixX4(qa[mt], a_q + Swz<Tr::kRowBytes>(warp_row0 + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
        }
      }
#pragma unroll
      for (int np = 0; np < KB / 16; ++np) {
        uint32_t kb[4];
        mma::LdMatrixX4(kb, k_stage + Swz<Tr::kRowBytes>(np * 16 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::Mma16816<TG>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
          mma::Mma16816<TG>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }

    // ---- Mask (boundary blocks only), online softmax in base 2.
    const int block_start = kv_begin + b * KB;
    const bool need_mask = block_start < full_begin || block_start + KB > full_end;
    if (need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const KeyRange sees = row_keys(mt, h);
#pragma unroll
          for (int n = 0; n < KB / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int pos = block_start + n * 8 + (lane & 3) * 2 + e;
              if (pos < sees.begin || pos >= sees.end) s[mt][n][2 * h + e] = -INFINITY;
            }
          }
        }
      }
    }
    {
      // s holds raw logits; m_run is in scaled base-2 units. A row's running
      // max moves only when the block's max exceeds it by more than
      // kLazyRescale, and then for the whole warp at once (one vote), so most
      // blocks skip the O rescale. Between moves p = 2^(s * scale - m) <=
      // 2^kLazyRescale: no overflow in fp32 or bf16, and O / l share the same
      // stale m, so the result is unchanged.
      float mx2[MT][2];
      bool grow = false;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = -INFINITY;
#pragma unroll
          for (int n = 0; n < KB / 8; ++n) {
            mx = fmaxf(mx, fmaxf(s[mt][n][2 * h], s[mt][n][2 * h + 1]));
          }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          mx2[mt][h] = row_logit(mt, h).Log2(mx);
          grow |= mx2[mt][h] > m_run[mt][h] + kLazyRescale;
        }
      }
      if (__any_sync(0xffffffffu, grow)) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float m_new = fmaxf(m_run[mt][h], mx2[mt][h]);
            const float alpha = Exp2(m_run[mt][h] - (m_new == -INFINITY ? 0.f : m_new));
            m_run[mt][h] = m_new;
            l_run[mt][h] *= alpha;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
              o_acc[mt][n][2 * h] *= alpha;
              o_acc[mt][n][2 * h + 1] *= alpha;
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float neg_m = m_run[mt][h] == -INFINITY ? 0.f : -m_run[mt][h];
          const LogitTransform lt = row_logit(mt, h);
          float sum = 0.f;
          if (logit.capped()) {
#pragma unroll
            for (int n = 0; n < KB / 8; ++n) {
              const float p0 = Exp2(lt.Log2(s[mt][n][2 * h]) + neg_m);
              const float p1 = Exp2(lt.Log2(s[mt][n][2 * h + 1]) + neg_m);
              s[mt][n][2 * h] = p0;
              s[mt][n][2 * h + 1] = p1;
              sum += p0 + p1;
            }
          } else {
#pragma unroll
            for (int n = 0; n < KB / 8; ++n) {
              const float p0 = Exp2(fmaf(s[mt][n][2 * h], lt.mul, neg_m));
              const float p1 = Exp2(fmaf(s[mt][n][2 * h + 1], lt.mul, neg_m));
              s[mt][n][2 * h] = p0;
              s[mt][n][2 * h + 1] = p1;
              sum += p0 + p1;
            }
          }
          l_run[mt][h] += sum;
        }
      }
    }

    // ---- O += P V.
    const uint32_t v_stage = a_v + (kFp8 ? 0 : stage) * Tr::kKvBytes;
#pragma unroll
    for (int j = 0; j < KB / 16; ++j) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = Pack2<TG>(s[mt][2 * j][0], s[mt][2 * j][1]);
        pa[mt][1] = Pack2<TG>(s[mt][2 * j][2], s[mt][2 * j][3]);
        pa[mt][2] = Pack2<TG>(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
        pa[mt][3] = Pack2<TG>(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        mma::LdMatrixX4Trans(vb, v_stage + Swz<Tr::kRowBytes>(j * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), dp * 2 + (lane >> 4)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::Mma16816<TG>(o_acc[mt][2 * dp], pa[mt], vb[0], vb[1]);
          mma::Mma16816<TG>(o_acc[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    if (next_offs) s_off[(b & 1) * KB + tid] = off_next;
    __syncthreads();  // the next iteration refills this stage
  }
  // No block ran, so no loop barrier ordered the Q tile's cp.async (each
  // thread loads rows of every warp) before the epilogue stages this warp's
  // output into its Q rows: wait for all threads' copies, not just our own.
  if (num_blocks == 0) {
    mma::CpAsyncWait<0>();
    __syncthreads();  // num_blocks is uniform over the CTA
  }

  // ---- Epilogue: normalise, LSE (base 2 internally), write. The item of
  // chunk 0 carries the rows' sinks (kernels/variant.h, EndRow).
  float inv[MT][2];
  float lse2[MT][2];
  const bool sinks = seq.sink_index >= 0 && item.chunk == 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[mt][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      float sink2 = -INFINITY;
      if (sinks) {
        const int pr = row_base + mt * 16 + h * 8;
        const int t = pr / group;
        if (t < q_len) {
          sink2 = __ldg(args.p.sinks + (int64_t)seq.sink_index * H + kvh * group + (pr - t * group)) * kLog2e;
        }
      }
      const RowEnd end = EndRow(m_run[mt][h], l, sink2);
      inv[mt][h] = kFp8 ? end.o_scale * v_scale : end.o_scale;
      lse2[mt][h] = end.lse2;
    }
  }

  if (item.part_base >= 0) {
    // Split chunk: fp32 partial (o, lse) into the workspace.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pr = item.row_begin + warp_row0 + mt * 16 + (lane >> 2) + h * 8;
        const int t = pr / group;
        if (t >= q_len) continue;
        const int head = kvh * group + (pr - t * group);
        const int64_t pair = (int64_t)item.part_base + (int64_t)t * H + head;
        float* dst = args.part_o + pair * D + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          *reinterpret_cast<float2*>(dst + n * 8) =
              make_float2(o_acc[mt][n][2 * h] * inv[mt][h], o_acc[mt][n][2 * h + 1] * inv[mt][h]);
        }
        if ((lane & 3) == 0) args.part_lse[pair] = lse2[mt][h];
      }
    }
    return;
  }

  // Final output: stage this warp's rows in its own part of the Q tile, then
  // write 16-byte chunks.
  __syncwarp();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_row0 + mt * 16 + (lane >> 2) + h * 8;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const uint32_t v = Pack2<T>(o_acc[mt][n][2 * h] * inv[mt][h], o_acc[mt][n][2 * h + 1] * inv[mt][h]);
        *reinterpret_cast<uint32_t*>(s_q + Swz<Tr::kRowBytes>(r, n) + (lane & 3) * 4) = v;
      }
      if ((lane & 3) == 0) {
        const int pr = item.row_begin + r;
        const int t = pr / group;
        if (t < q_len) {
          const int head = kvh * group + (pr - t * group);
          const float v = seq.lse_base_e ? lse2[mt][h] * kLn2 : lse2[mt][h];
          args.p.lse[(int64_t)(seq.q_start + t) * H + head] = v;
        }
      }
    }
  }
  __syncwarp();
  T* o = static_cast<T*>(args.p.o);
  constexpr int kWarpChunks = 16 * MT * Tr::kChunks;
#pragma unroll
  for (int i = 0; i < kWarpChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = warp_row0 + idx / Tr::kChunks;
    const int c = idx % Tr::kChunks;
    const int pr = item.row_begin + r;
    const int t = pr / group;
    if (t < q_len) {
      const int head = kvh * group + (pr - t * group);
      const uint4 v = *reinterpret_cast<const uint4*>(s_q + Swz<Tr::kRowBytes>(r, c));
      *reinterpret_cast<uint4*>(o + ((int64_t)(seq.q_start + t) * H + head) * D + c * 8) = v;
    }
  }
}

}  // namespace sm80
}  // namespace attnserve
