// Paged prefill attention, FlashAttention-2 style on mma.sync (sm_80+):
// 4 warps per CTA, each warp owns 16 * MT packed query rows; K/V stream in
// blocks of KB tokens through double-buffered cp.async into XOR-swizzled
// shared memory; online softmax in base 2 with the scale folded in; O stays in
// registers. One CTA per work item of the host plan (paged_prefill_cuda.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "kernels/mma_sm80.cuh"
#include "kernels/paged_prefill_cuda.h"

namespace attnserve {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// Largest growth (base 2) of a row's max that leaves O unrescaled (LAZY).
constexpr float kLazyRescale = 8.f;

struct PrefillKernelArgs {
  const void* q;            // (total_q, H, D)
  void* o;                  // (total_q, H, D)
  float* lse;               // (total_q, H)
  const void* k_cache;      // (L, pages, page_size, KVH, D)
  const void* v_cache;
  const int32_t* kv_indices;
  const PrefillSeq* seqs;
  const PrefillWorkItem* items;
  float* part_o;            // (pairs, D) fp32
  float* part_lse;          // (pairs) base 2
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  int32_t page_size;
  int64_t slots_per_layer;
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

// Byte offset of 16-byte chunk c of row r in a swizzled tile.
template <int ROW_BYTES>
__device__ __forceinline__ uint32_t Swz(int r, int c) {
  return r * ROW_BYTES + ((c ^ (r & 7)) << 4);
}

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// LAZY: scale folded into the exponent's FFMA and the O rescale skipped
// while no row's max grows by more than kLazyRescale (see the softmax).
template <int D, int MT, int KB, bool LAZY, typename T>
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
  const PrefillSeq seq = args.seqs[item.seq];
  const int H = args.num_qo_heads;
  const int KVH = args.num_kv_heads;
  const int group = H / KVH;
  const int kvh = item.kv_head;
  const int q_len = seq.q_len;
  const int diag = seq.kv_len - seq.q_len + seq.causal_shift;  // row t sees j <= t + diag
  const bool causal = seq.causal != 0;

  const int t_first = item.row_begin / group;
  const int t_last = min(q_len - 1, (item.row_begin + Tr::kM - 1) / group);
  int kv_end = item.kv_end;
  int full_end = item.kv_end;  // blocks ending at or before this need no mask
  if (causal) {
    kv_end = min(kv_end, t_last + diag + 1);
    full_end = min(full_end, t_first + diag + 1);
  }
  const int kv_begin = item.kv_begin;
  const int num_blocks = kv_end > kv_begin ? (kv_end - kv_begin + KB - 1) / KB : 0;

  // ---- Q tile: packed row r -> token r / group, head kvh * group + r % group.
  const T* q = static_cast<const T*>(args.q);
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
  const T* k_base = static_cast<const T*>(args.k_cache) + kv_base;
  const T* v_base = static_cast<const T*>(args.v_cache) + kv_base;
  const int32_t* pages = args.kv_indices + seq.kv_start;
  const int ps = args.page_size;

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
  // KV positions < RowLimit(mt, h) are visible to the thread's row (mt, h);
  // recomputed on boundary blocks only, to keep registers for the tiles.
  const int item_kv_end = item.kv_end;
  const int row_base = item.row_begin + warp_row0 + (lane >> 2);
  auto row_limit = [&](int mt, int h) {
    const int t = (row_base + mt * 16 + h * 8) / group;
    return causal ? min(item_kv_end, t + diag + 1) : item_kv_end;
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
  // LAZY takes row maxima on raw logits, so it needs a positive scale: a
  // negative one is moved into Q (sign flip in shared memory, once), and a
  // zero one becomes 1e-30 (every logit rounds to 0 either way, while masked
  // logits stay -inf instead of -inf * 0).
  const bool negate_q = LAZY && seq.sm_scale < 0.f;
  const float scale_log2 =
      LAZY ? fmaxf(fabsf(seq.sm_scale) * kLog2e, 1e-30f) : seq.sm_scale * kLog2e;

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
    const bool need_mask = block_start + KB > full_end;
    if constexpr (!LAZY) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int n = 0; n < KB / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][n][e] *= scale_log2;
        }
      }
    }
    if (need_mask) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int lim = row_limit(mt, h);
#pragma unroll
          for (int n = 0; n < KB / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int pos = block_start + n * 8 + (lane & 3) * 2 + e;
              if (pos >= lim) s[mt][n][2 * h + e] = -INFINITY;
            }
          }
        }
      }
    }
    if constexpr (LAZY) {
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
          mx2[mt][h] = mx * scale_log2;
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
#pragma unroll
          for (int n = 0; n < KB / 8; ++n) {
            const float p0 = Exp2(fmaf(s[mt][n][2 * h], scale_log2, neg_m));
            const float p1 = Exp2(fmaf(s[mt][n][2 * h + 1], scale_log2, neg_m));
            s[mt][n][2 * h] = p0;
            s[mt][n][2 * h + 1] = p1;
            sum += p0 + p1;
          }
          l_run[mt][h] += sum;
        }
      }
    } else {
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
        const float m_new = fmaxf(m_run[mt][h], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = Exp2(m_run[mt][h] - m_use);
        m_run[mt][h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < KB / 8; ++n) {
          const float p0 = Exp2(s[mt][n][2 * h] - m_use);
          const float p1 = Exp2(s[mt][n][2 * h + 1] - m_use);
          s[mt][n][2 * h] = p0;
          s[mt][n][2 * h + 1] = p1;
          sum += p0 + p1;
        }
        l_run[mt][h] = l_run[mt][h] * alpha + sum;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o_acc[mt][n][2 * h] *= alpha;
          o_acc[mt][n][2 * h + 1] *= alpha;
        }
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
        pa[mt][0] = mma::Pack2<T>(s[mt][2 * j][0], s[mt][2 * j][1]);
        pa[mt][1] = mma::Pack2<T>(s[mt][2 * j][2], s[mt][2 * j][3]);
        pa[mt][2] = mma::Pack2<T>(s[mt][2 * j + 1][0], s[mt][2 * j + 1][1]);
        pa[mt][3] = mma::Pack2<T>(s[mt][2 * j + 1][2], s[mt][2 * j + 1][3]);
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

  // ---- Epilogue: normalise, LSE (base 2 internally), write.
  float inv[MT][2];
  float lse2[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[mt][h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      inv[mt][h] = l > 0.f ? 1.f / l : 0.f;
      lse2[mt][h] = l > 0.f ? m_run[mt][h] + log2f(l) : -INFINITY;
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
        const uint32_t v = mma::Pack2<T>(o_acc[mt][n][2 * h] * inv[mt][h], o_acc[mt][n][2 * h + 1] * inv[mt][h]);
        *reinterpret_cast<uint32_t*>(s_q + Swz<Tr::kRowBytes>(r, n) + (lane & 3) * 4) = v;
      }
      if ((lane & 3) == 0) {
        const int pr = item.row_begin + r;
        const int t = pr / group;
        if (t < q_len) {
          const int head = kvh * group + (pr - t * group);
          const float v = seq.lse_base_e ? lse2[mt][h] * kLn2 : lse2[mt][h];
          args.lse[(int64_t)(seq.q_start + t) * H + head] = v;
        }
      }
    }
  }
  __syncwarp();
  T* o = static_cast<T*>(args.o);
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

// Merge of split partials: one warp per (row, head) pair.
template <int D, typename T>
__global__ void __launch_bounds__(256)
    MergeSplitsKernel(const SplitMergeSeq* merges, int32_t num_merges,
                      int32_t merge_pairs, const float* part_o,
                      const float* part_lse, T* o, float* lse, int32_t H) {
  constexpr int kVec = D / 32;  // floats per lane
  const int pair = blockIdx.x * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (pair >= merge_pairs) return;
  int lo = 0, hi = num_merges - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (merges[mid].pair_begin <= pair) lo = mid; else hi = mid - 1;
  }
  const SplitMergeSeq ms = merges[lo];
  const int local = pair - ms.pair_begin;
  const int64_t chunk_stride = (int64_t)ms.q_len * H;
  const int64_t base = ms.part_off + local;

  float m = -INFINITY;
  for (int c = 0; c < ms.num_chunks; ++c) m = fmaxf(m, __ldg(part_lse + base + c * chunk_stride));
  float acc[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] = 0.f;
  float wsum = 0.f;
  if (m != -INFINITY) {
    for (int c = 0; c < ms.num_chunks; ++c) {
      const float l = __ldg(part_lse + base + c * chunk_stride);
      if (l == -INFINITY) continue;
      const float w = Exp2(l - m);
      wsum += w;
      const float* src = part_o + (base + c * chunk_stride) * D + lane * kVec;
      if constexpr (kVec == 2) {
        const float2 v = __ldg(reinterpret_cast<const float2*>(src));
        acc[0] += w * v.x; acc[1] += w * v.y;
      } else {
#pragma unroll
        for (int i = 0; i < kVec; i += 4) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(src + i));
          acc[i] += w * v.x; acc[i + 1] += w * v.y; acc[i + 2] += w * v.z; acc[i + 3] += w * v.w;
        }
      }
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  const int t = local / H;
  const int head = local - t * H;
  const int64_t row = (int64_t)(ms.q_start + t) * H + head;
  uint32_t packed[kVec / 2];
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) packed[i] = mma::Pack2<T>(acc[2 * i] * inv, acc[2 * i + 1] * inv);
  T* dst = o + row * D + lane * kVec;
  if constexpr (kVec == 2) {
    *reinterpret_cast<uint32_t*>(dst) = packed[0];
  } else if constexpr (kVec == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
  if (lane == 0) {
    float v = wsum > 0.f ? m + log2f(wsum) : -INFINITY;
    if (ms.lse_base_e && wsum > 0.f) v *= kLn2;
    lse[row] = v;
  }
}

template <int D, int MT, int KB, bool LAZY, typename T>
cudaError_t LaunchPrefill(const PrefillKernelArgs& args, int32_t num_items, cudaStream_t stream) {
  using Tr = Traits<D, MT, KB>;
  auto kernel = PagedPrefillKernel<D, MT, KB, LAZY, T>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<num_items, Tr::kThreads, Tr::kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

template <int D, int MT, int KB, bool LAZY, typename T>
int32_t CtasPerSm() {
  using Tr = Traits<D, MT, KB>;
  auto kernel = PagedPrefillKernel<D, MT, KB, LAZY, T>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes) != cudaSuccess) return 1;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Tr::kThreads, Tr::kSmemBytes) != cudaSuccess) return 1;
  return std::max(n, 1);
}

// Turns the run-time (head_dim, variant, dtype) into the kernel's constants.
// Variant 2 is the 128-row tile with the v2 softmax, for A/B in the bench.
#define ATTNSERVE_DISPATCH_PREFILL_T(head_dim, variant, FN, ...)                     \
  if ((head_dim) == 64) return FN<64, 2, 64, true, T>(__VA_ARGS__);                  \
  if ((head_dim) == 128 && (variant) == 1) return FN<128, 1, 64, true, T>(__VA_ARGS__); \
  if ((head_dim) == 128 && (variant) == 2) return FN<128, 2, 64, false, T>(__VA_ARGS__); \
  if ((head_dim) == 128) return FN<128, 2, 64, true, T>(__VA_ARGS__);                \
  return FN<256, 1, 32, true, T>(__VA_ARGS__)
#define ATTNSERVE_DISPATCH_PREFILL(head_dim, variant, dtype, FN, ...)        \
  [&]() {                                                                     \
    if ((dtype) == KvDType::kBf16) {                                          \
      using T = __nv_bfloat16;                                                \
      ATTNSERVE_DISPATCH_PREFILL_T(head_dim, variant, FN, __VA_ARGS__);       \
    } else {                                                                  \
      using T = __half;                                                       \
      ATTNSERVE_DISPATCH_PREFILL_T(head_dim, variant, FN, __VA_ARGS__);       \
    }                                                                         \
  }()

}  // namespace

int32_t PrefillTileRows(int32_t head_dim, int32_t variant) {
  if (head_dim == 64) return Traits<64, 2, 64>::kM;
  if (head_dim == 128) return variant == 1 ? Traits<128, 1, 64>::kM : Traits<128, 2, 64>::kM;
  return Traits<256, 1, 32>::kM;
}

int32_t PrefillCtasPerSm(int32_t head_dim, KvDType dtype, int32_t variant) {
  return ATTNSERVE_DISPATCH_PREFILL(head_dim, variant, dtype, CtasPerSm);
}

void BuildPrefillPlan(const PrefillSeq* seqs, int32_t num_seqs, const KvGeometry& geo,
                      const PrefillPlanOptions& options, PrefillPlan* plan) {
  plan->items.clear();
  plan->merges.clear();
  plan->partial_pairs = 0;
  plan->merge_pairs = 0;
  const int H = geo.num_qo_heads;
  const int KVH = geo.num_kv_heads;
  const int group = H / KVH;
  const int M = options.tile_rows;
  constexpr int kBlock = 64;

  auto tiles_of = [&](const PrefillSeq& s) { return (s.q_len * group + M - 1) / M; };
  int64_t base_items = 0;
  int64_t total_work = 0;  // KV tokens summed over unsplit items
  for (int i = 0; i < num_seqs; ++i) {
    const PrefillSeq& s = seqs[i];
    if (s.q_len <= 0) continue;
    base_items += int64_t{KVH} * tiles_of(s);
    total_work += int64_t{KVH} * tiles_of(s) * std::max(s.kv_len, kBlock);
  }

  // Split only when the batch alone would leave SMs idle.
  const int64_t wave = int64_t{options.num_sms} * std::max(options.ctas_per_sm, 1);
  const int64_t target = options.target_items > 0 ? options.target_items : 2 * wave;
  std::vector<int32_t> chunks(num_seqs, 1);
  int64_t chunk_len = 0;
  if (base_items > 0 && base_items < wave && options.max_partial_pairs > 0) {
    chunk_len = std::max<int64_t>(options.min_chunk, (total_work / target + kBlock - 1) / kBlock * kBlock);
    for (;;) {
      int64_t pairs = 0;
      bool any = false;
      for (int i = 0; i < num_seqs; ++i) {
        const PrefillSeq& s = seqs[i];
        chunks[i] = 1;
        if (s.q_len <= 0 || s.kv_len <= chunk_len) continue;
        chunks[i] = static_cast<int32_t>((s.kv_len + chunk_len - 1) / chunk_len);
        pairs += int64_t{chunks[i]} * s.q_len * H;
        any = true;
      }
      if (!any) { chunk_len = 0; break; }
      if (pairs <= options.max_partial_pairs && pairs < INT32_MAX) break;
      chunk_len *= 2;
    }
  }

  int64_t part_off = 0;
  int32_t pair_begin = 0;
  for (int i = 0; i < num_seqs; ++i) {
    const PrefillSeq& s = seqs[i];
    if (s.q_len <= 0) continue;
    const int nt = tiles_of(s);
    const int nc = chunks[i];
    if (nc > 1) {
      SplitMergeSeq ms;
      ms.q_start = s.q_start;
      ms.q_len = s.q_len;
      ms.num_chunks = nc;
      ms.part_off = static_cast<int32_t>(part_off);
      ms.pair_begin = pair_begin;
      ms.lse_base_e = s.lse_base_e;
      plan->merges.push_back(ms);
      pair_begin += s.q_len * H;
    }
    for (int kvh = 0; kvh < KVH; ++kvh) {
      for (int tile = 0; tile < nt; ++tile) {
        for (int c = 0; c < nc; ++c) {
          PrefillWorkItem it;
          it.seq = i;
          it.kv_head = kvh;
          it.row_begin = tile * M;
          if (nc > 1) {
            it.kv_begin = static_cast<int32_t>(c * chunk_len);
            it.kv_end = static_cast<int32_t>(std::min<int64_t>((c + 1) * chunk_len, s.kv_len));
            it.part_base = static_cast<int32_t>(part_off + int64_t{c} * s.q_len * H);
          } else {
            it.kv_begin = 0;
            it.kv_end = s.kv_len;
            it.part_base = -1;
          }
          plan->items.push_back(it);
        }
      }
    }
    if (nc > 1) part_off += int64_t{nc} * s.q_len * H;
  }
  plan->partial_pairs = part_off;
  plan->merge_pairs = pair_begin;

  // Order: L2 sections of whole (sequence, KV head) groups, longest item
  // first inside each section. Every tile of a group reads the same K/V rows;
  // a plain global longest-first order runs the same tile of every group at
  // once, so the resident CTAs touch every group's K/V and each tile re-reads
  // it from DRAM (prefix 32x512/4096: 268 MB live against a 60 MB L2). A
  // section holds groups whose K/V bytes sum to at most l2_section_bytes, so
  // the CTAs in flight (about one section) share what is in L2, while the
  // tail of the grid still holds the short items of the last section.
  auto cost = [&](const PrefillWorkItem& it) {
    const PrefillSeq& s = seqs[it.seq];
    int end = it.kv_end;
    if (s.causal) {
      const int t_last = std::min(s.q_len - 1, (it.row_begin + M - 1) / group);
      end = std::min(end, t_last + s.kv_len - s.q_len + s.causal_shift + 1);
    }
    return std::max(end - it.kv_begin, 0);
  };
  const size_t n = plan->items.size();
  std::vector<int32_t> costs(n);
  for (size_t i = 0; i < n; ++i) costs[i] = cost(plan->items[i]);
  // Items were emitted group by group: [group_begin[g], group_begin[g + 1]).
  std::vector<int32_t> group_begin;
  std::vector<int32_t> group_max;    // longest item of the group (tokens)
  std::vector<int64_t> group_bytes;  // K + V bytes the group reads
  const int64_t token_bytes = int64_t{2} * geo.head_dim * 2;  // K and V, 16-bit
  for (size_t i = 0; i < n; ++i) {
    const PrefillWorkItem& it = plan->items[i];
    if (i == 0 || it.seq != plan->items[i - 1].seq || it.kv_head != plan->items[i - 1].kv_head) {
      group_begin.push_back(static_cast<int32_t>(i));
      group_max.push_back(0);
      group_bytes.push_back(int64_t{seqs[it.seq].kv_len} * token_bytes);
    }
    group_max.back() = std::max(group_max.back(), costs[i]);
  }
  group_begin.push_back(static_cast<int32_t>(n));
  const int num_groups = static_cast<int>(group_max.size());
  std::vector<int32_t> group_order(num_groups);
  std::iota(group_order.begin(), group_order.end(), 0);
  std::stable_sort(group_order.begin(), group_order.end(),
                   [&](int32_t a, int32_t b) { return group_max[a] > group_max[b]; });

  std::vector<int32_t> order;
  order.reserve(n);
  const int64_t budget = options.l2_section_bytes > 0 ? options.l2_section_bytes : INT64_MAX;
  auto by_cost = [&](int32_t a, int32_t b) { return costs[a] > costs[b]; };
  for (int gi = 0; gi < num_groups;) {
    const size_t section_begin = order.size();
    int64_t bytes = 0;
    do {
      const int32_t g = group_order[gi++];
      bytes += group_bytes[g];
      for (int32_t i = group_begin[g]; i < group_begin[g + 1]; ++i) order.push_back(i);
    } while (gi < num_groups && bytes + group_bytes[group_order[gi]] <= budget);
    std::stable_sort(order.begin() + section_begin, order.end(), by_cost);
  }
  std::vector<PrefillWorkItem> sorted(n);
  for (size_t i = 0; i < n; ++i) sorted[i] = plan->items[order[i]];
  plan->items.swap(sorted);
}

cudaError_t PagedPrefillCuda(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse, int32_t variant,
                             cudaStream_t stream) {
  const KvGeometry& geo = params.geo;
  if (geo.head_dim != 64 && geo.head_dim != 128 && geo.head_dim != 256) return cudaErrorInvalidValue;
  if (geo.num_kv_heads <= 0 || geo.num_qo_heads % geo.num_kv_heads != 0) return cudaErrorInvalidValue;
  if (num_items == 0) return cudaSuccess;
  PrefillKernelArgs args;
  args.q = params.q;
  args.o = params.o;
  args.lse = params.lse;
  args.k_cache = params.k_cache;
  args.v_cache = params.v_cache;
  args.kv_indices = params.kv_indices;
  args.seqs = params.seqs;
  args.items = items;
  args.part_o = part_o;
  args.part_lse = part_lse;
  args.num_qo_heads = geo.num_qo_heads;
  args.num_kv_heads = geo.num_kv_heads;
  args.page_size = geo.page_size;
  args.slots_per_layer = geo.SlotsPerLayer();
  return ATTNSERVE_DISPATCH_PREFILL(geo.head_dim, variant, geo.dtype, LaunchPrefill, args, num_items, stream);
}

cudaError_t MergeSplitsCuda(const PagedPrefillParams& params, const SplitMergeSeq* merges,
                            int32_t num_merges, int32_t merge_pairs, const float* part_o,
                            const float* part_lse, cudaStream_t stream) {
  if (merge_pairs == 0) return cudaSuccess;
  const int blocks = (merge_pairs + 7) / 8;
  const int H = params.geo.num_qo_heads;
#define ATTNSERVE_LAUNCH_MERGE_SPLITS(D, T)                                              \
  MergeSplitsKernel<D, T><<<blocks, 256, 0, stream>>>(merges, num_merges, merge_pairs, \
                                                      part_o, part_lse,                 \
                                                      static_cast<T*>(params.o), params.lse, H)
  const bool bf16 = params.geo.dtype == KvDType::kBf16;
  switch (params.geo.head_dim) {
    case 64:
      if (bf16) ATTNSERVE_LAUNCH_MERGE_SPLITS(64, __nv_bfloat16); else ATTNSERVE_LAUNCH_MERGE_SPLITS(64, __half);
      break;
    case 128:
      if (bf16) ATTNSERVE_LAUNCH_MERGE_SPLITS(128, __nv_bfloat16); else ATTNSERVE_LAUNCH_MERGE_SPLITS(128, __half);
      break;
    case 256:
      if (bf16) ATTNSERVE_LAUNCH_MERGE_SPLITS(256, __nv_bfloat16); else ATTNSERVE_LAUNCH_MERGE_SPLITS(256, __half);
      break;
    default:
      return cudaErrorInvalidValue;
  }
#undef ATTNSERVE_LAUNCH_MERGE_SPLITS
  return cudaGetLastError();
}

}  // namespace attnserve
