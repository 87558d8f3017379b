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
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/math.h"
#include "kernels/sm80/mma.cuh"
#include "kernels/sm80/traits.cuh"
#include "kernels/variant.h"

namespace attnserve {
namespace sm80 {

// One CTA per work item. The scale is folded into the exponent's FFMA and the
// O rescale is skipped while no row's max grows by more than kLazyRescale
// (see the softmax).
template <int D, int MT, int KB, typename T>
__global__ void __launch_bounds__(128, 2)
    PagedPrefillKernel(const PrefillKernelArgs args) {
  using Tr = Traits<D, MT, KB>;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_q = smem;
  uint8_t* s_k = smem + Tr::kQBytes;               // 2 stages
  uint8_t* s_v = s_k + 2 * Tr::kKvBytes;           // 2 stages
  // Element offsets of the K/V rows of the next two blocks (-1: past the end),
  // computed one block ahead so no page-table load sits on the issue path.
  int64_t* s_off = reinterpret_cast<int64_t*>(s_v + 2 * Tr::kKvBytes);
  const uint32_t a_q = mma::SmemAddr(s_q);
  const uint32_t a_k = mma::SmemAddr(s_k);
  const uint32_t a_v = mma::SmemAddr(s_v);

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
  const T* q = static_cast<const T*>(args.p.q);
  {
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
  };

  for (int r = tid; r < 2 * KB; r += Tr::kThreads) {
    s_off[r] = r < KB ? page_offset(0, r) : page_offset(1, r - KB);
  }
  __syncthreads();
  if (num_blocks > 0) issue_kv(0);
  mma::CpAsyncCommit();

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
  const LogitTransform logit = LogitTransform::Of(seq, /*positive_scale=*/true);

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
    if (negate_q && b == 0) {  // the Q tile landed with block 0
#pragma unroll
      for (int i = tid; i < Tr::kQBytes / 16; i += Tr::kThreads) {
        uint4* p = reinterpret_cast<uint4*>(s_q) + i;
        uint4 v = *p;
        v.x ^= 0x80008000u; v.y ^= 0x80008000u; v.z ^= 0x80008000u; v.w ^= 0x80008000u;
        *p = v;
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
    const uint32_t k_stage = a_k + stage * Tr::kKvBytes;
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
          mma::Mma16816<T>(s[mt][2 * np], qa[mt], kb[0], kb[1]);
          mma::Mma16816<T>(s[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
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
          mx2[mt][h] = logit.Log2(mx);
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
          float sum = 0.f;
          if (logit.capped()) {
#pragma unroll
            for (int n = 0; n < KB / 8; ++n) {
              const float p0 = Exp2(logit.Log2(s[mt][n][2 * h]) + neg_m);
              const float p1 = Exp2(logit.Log2(s[mt][n][2 * h + 1]) + neg_m);
              s[mt][n][2 * h] = p0;
              s[mt][n][2 * h + 1] = p1;
              sum += p0 + p1;
            }
          } else {
#pragma unroll
            for (int n = 0; n < KB / 8; ++n) {
              const float p0 = Exp2(fmaf(s[mt][n][2 * h], logit.mul, neg_m));
              const float p1 = Exp2(fmaf(s[mt][n][2 * h + 1], logit.mul, neg_m));
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
    const uint32_t v_stage = a_v + stage * Tr::kKvBytes;
#pragma unroll
    for (int j = 0; j < KB / 16; ++j) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = Pack2<T>(s[mt][2 * j][0], s[mt][2 * j][1]);
        pa[mt][1] = Pack2<T>(s[mt][2 * j][2], s[mt][2 * j][3]);
        pa[mt][2] = Pack2<T>(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
        pa[mt][3] = Pack2<T>(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        mma::LdMatrixX4Trans(vb, v_stage + Swz<Tr::kRowBytes>(j * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), dp * 2 + (lane >> 4)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::Mma16816<T>(o_acc[mt][2 * dp], pa[mt], vb[0], vb[1]);
          mma::Mma16816<T>(o_acc[mt][2 * dp + 1], pa[mt], vb[2], vb[3]);
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
      inv[mt][h] = end.o_scale;
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
