// The MLA family's Hopper kernel (kernels/mla/mla_sm90.h): one CTA a work
// item of 64 packed (query row, head) pairs and one KV chunk, as the
// family's other kernel (kernels/mla/mla.cu) and with its semantics, but its
// GEMMs by wgmma from shared memory.
//
// 3 warpgroups:
//  - warpgroup 0 computes S = Q K^T (64 x 64 over 576, m64n64k16; Q's first
//    384 columns from registers, the rest and K from shared memory), the
//    mask, the logit transform and the online softmax in base 2 (lazy
//    rescale), and writes P (16-bit, 64 x 64, K-major) and each row's
//    rescale factor to shared memory. It holds no part of O and loads
//    nothing: it is the critical path.
//  - warpgroups 1 and 2 each hold half of O (64 x 256 fp32): they rescale it
//    by the factors and run O += P V on their columns (m64n256k16, V being
//    the first 512 columns of the same key block, MN-major), release the
//    stage, and, once both have (256 arrivals), load the block two on into
//    it by cp.async, its mbarrier tracking the copies
//    (cp.async.mbarrier.arrive.noinc). They load Q's tile (64 x 576) and the
//    first two blocks at the start. Key blocks are 64 latent rows (72 KiB,
//    two stages); rows past the chunk's end are zero-filled; each row's
//    page is looked up a block ahead. All tiles are 128-byte swizzled column
//    blocks of 64 columns (sm90::TileOff), the wgmma canonical layout. (A
//    fourth, producer warpgroup would cap every thread at 128 registers,
//    below what an m64n256k16 needs.)
// So P V of block b runs beside S of block b + 1 and its softmax (they share
// the tensor pipe; the softmax and the P write leave it idle, and a third
// stage that would let the next S run there does not fit: bench/results/
// 2026-12-02-session15-h200.md). Named barriers over the three
// warpgroups pass P: "P ready" (warpgroup 0 wrote P and the
// factors), "P free" (the P V of the block before have read them); every
// one is a sync on all sides. One P buffer suffices: warpgroup 0 writes
// P_{b+1} only after S_{b+1} and its softmax, by when P V_b has long ended.
// Shared memory: Q 72 KiB, two stages 144 KiB, P 8 KiB, 768 bytes of row
// factors, the barriers (225.8 KiB with the alignment slack).
#include "kernels/mla/mla_sm90.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/fast_div.h"
#include "kernels/math.h"
#include "kernels/mla/mla_args.cuh"
#include "kernels/numerics.cuh"
#include "kernels/per_device.h"
#include "kernels/sm90/ptx.cuh"
#include "kernels/sm90/traits.cuh"
#include "kernels/variant.h"

namespace attnserve {
namespace mla_sm90 {
namespace {

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNSERVE_MLA_SM90_DEVICE 1
#else
#define ATTNSERVE_MLA_SM90_DEVICE 0
#endif

using sm90::CpAsync16;
using sm90::CpAsyncArriveNoinc;
using sm90::CpAsyncWaitAll;
using sm90::FenceProxyAsync;
using sm90::FenceRegs;
using sm90::kLazyRescale;
using sm90::MakeDesc;
using sm90::MbarArrive;
using sm90::MbarInit;
using sm90::MbarWait;
using sm90::NamedBarSync;
using sm90::SmemAddr;
using sm90::TileOff;
using sm90::WgmmaCommit;
using sm90::WgmmaFence;
using sm90::WgmmaWait;

// (Constants only the sm_90a bodies read are [[maybe_unused]]: the other
// architectures compile trap stubs.)
constexpr int kM = kMlaSm90TileRows;  // packed rows a tile
constexpr int kN = kMlaSm90KeyBlock;  // keys a block
constexpr int kDqk = kMlaKvLoraRank + kMlaRopeDim;  // 576
constexpr int kDv = kMlaKvLoraRank;                  // 512
constexpr int kRowBytes = kDqk * 2;                  // 1152
[[maybe_unused]] constexpr int kChunks = kRowBytes / 16;              // 72
constexpr int kColBlocks = kDqk / 64;                // 9 column blocks of 128 bytes
[[maybe_unused]] constexpr int kHalf = kDv / 2;                       // O columns a consumer warpgroup owns
constexpr int kStages = 2;
constexpr int kThreads = 384;
static_assert(kM == 64 && kN == 64, "one wgmma M of rows, N of keys");

// Shared memory, from the 1024-byte aligned base.
constexpr int kColBlockBytes = 64 * 128;             // 64 rows of one column block
constexpr int kTileBytes = kColBlocks * kColBlockBytes;  // Q's tile or one key block: 72 KiB
constexpr int kOffQ = 0;
constexpr int kOffK = kOffQ + kTileBytes;
constexpr int kOffP = kOffK + kStages * kTileBytes;
constexpr int kOffAlpha = kOffP + kColBlockBytes;  // float[2][64]: blocks' rescale factors
constexpr int kOffScale = kOffAlpha + 2 * kM * 4;  // float[64]: the rows' final o scales
constexpr int kOffBar = kOffScale + kM * 4;
// Barriers: q_full, full[kStages], empty[kStages].
[[maybe_unused]] constexpr int kBarQ = 0;
constexpr int kBarFull = 1;
constexpr int kBarEmpty = kBarFull + kStages;
constexpr int kNumBars = kBarEmpty + kStages;
constexpr int kSmemBytes = kOffBar + kNumBars * 8 + 1024;  // + the alignment slack
static_assert(kSmemBytes <= 227 * 1024, "shared memory");
static_assert(kOffK % 1024 == 0 && kOffP % 1024 == 0, "swizzle atoms");

// setmaxnreg: 128 x (184 + 2 x 160) = 64,512, the 168 x 384 the kernel
// starts with (a sum above it leaves an increase waiting for registers that
// never come; sm90::Traits).
constexpr int kSoftmaxRegs = 184;
constexpr int kOutRegs = 160;
static_assert(128 * (kSoftmaxRegs + 2 * kOutRegs) <= 168 * 384, "register split");

// Named barrier ids (0 is __syncthreads).
[[maybe_unused]] constexpr int kBarPReady = 1;
[[maybe_unused]] constexpr int kBarPFree = 2;
[[maybe_unused]] constexpr int kBarEnd = 3;
[[maybe_unused]] constexpr int kLoaders = 256;  // the threads of warpgroups 1 and 2
// Q's first column blocks stay in warpgroup 0's registers as wgmma A
// fragments (16 registers a column block): S's first k-steps then read
// only K from shared memory (decode at 128 heads 2% faster on the H200).
constexpr int kQRegBlocks = 6;
[[maybe_unused]] constexpr int kQRegSteps = kQRegBlocks * 4;  // k-steps of 16 with A from registers

using mla::Args;

template <typename T>
__device__ __forceinline__ void MlaCta(const Args& a) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  uint8_t* smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  const uint32_t base = SmemAddr(smem);
  const uint32_t a_q = base + kOffQ;
  const uint32_t a_k = base + kOffK;
  const uint32_t a_p = base + kOffP;
  // Two buffers of factors, by block parity: warpgroup 0 writes block b + 1's
  // beside warpgroups 1 and 2's reads of block b's.
  float(*const s_alpha)[kM] = reinterpret_cast<float(*)[kM]>(smem + kOffAlpha);
  float* const s_scale = reinterpret_cast<float*>(smem + kOffScale);
  const uint32_t bars = base + kOffBar;
  auto bar_full = [&](int s) { return bars + 8 * (kBarFull + s); };
  auto bar_empty = [&](int s) { return bars + 8 * (kBarEmpty + s); };

  const MlaWorkItem item = a.items[blockIdx.x];
  const PrefillSeq seq = a.seqs[item.seq];
  const int heads = a.heads;
  const int rows_total = seq.q_len * heads;
  const int num_blocks = item.kv_end > item.kv_begin ? (item.kv_end - item.kv_begin + kN - 1) / kN : 0;
  const int tid = threadIdx.x;
  const int wg = tid >> 7;

  if (tid == 0) {
    MbarInit(bars + 8 * kBarQ, kLoaders);
    for (int s = 0; s < kStages; ++s) {
      MbarInit(bar_full(s), kLoaders);
      MbarInit(bar_empty(s), kLoaders);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int ctid = tid & 127;
  const int warp = ctid >> 5;
  const int lane = tid & 31;
  const int r0 = warp * 16 + (lane >> 2);  // the thread's rows: r0 (h = 0) and r0 + 8 (h = 1)

  if (wg == 0) {
    // ======================= S = Q K^T and the softmax =======================
    sm90::RegAlloc<kSoftmaxRegs>();
    // The keys each of the thread's rows sees, clipped to the chunk.
    KeyRange keys[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = item.row_begin + r0 + 8 * h;
      KeyRange k;
      if (m < rows_total) k = RowKeys(seq, m / heads);
      k.begin = k.begin > item.kv_begin ? k.begin : item.kv_begin;
      k.end = k.end < item.kv_end ? k.end : item.kv_end;
      keys[h] = k;
    }
    const LogitTransform transform = LogitTransform::Of(seq, /*positive_scale=*/false);
    float m2[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.f, 0.f};  // this thread's columns; summed over the quad at the end
    float s[kN / 2];
    // Q's A fragments of k-steps 0 .. kQRegSteps - 1: the thread's rows r0
    // and r0 + 8, columns 16 kk + 2 (lane % 4) (+ 1) and 8 further.
    uint32_t qf[kQRegSteps][4];
    if (num_blocks > 0) {
      MbarWait(bars + 8 * kBarQ, 0);
#pragma unroll
      for (int kk = 0; kk < kQRegSteps; ++kk) {
        const int chunk = (kk >> 2) * 8 + (kk & 3) * 2;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t at = TileOff<kM>(r0 + 8 * (i & 1), chunk + (i >> 1)) + (lane & 3) * 4;
          qf[kk][i] = *reinterpret_cast<const uint32_t*>(smem + kOffQ + at);
        }
      }
    }
    for (int b = 0; b < num_blocks; ++b) {
      const int stage = b % kStages;
      MbarWait(bar_full(stage), (b / kStages) & 1);
      FenceProxyAsync();
      const uint32_t k_at = a_k + stage * kTileBytes;
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) s[i] = 0.f;
      FenceRegs(s);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kDqk / 16; ++kk) {
        const uint32_t off = (kk >> 2) * kColBlockBytes + (kk & 3) * 32;
        if (kk < kQRegSteps) {
          sm90::WgmmaRSKMajor<kN, T>(s, qf[kk], MakeDesc(k_at + off, 16, 1024));
        } else {
          sm90::WgmmaSS<kN, T>(s, MakeDesc(a_q + off, 16, 1024), MakeDesc(k_at + off, 16, 1024), 1);
        }
      }
      WgmmaCommit();
      WgmmaWait<0>();
      FenceRegs(s);
      // Logits (base 2), the mask where some row sees part of the block, the
      // block's row maxima (a row's 64 keys lie in its quad), P. Each choice
      // is made once for the warp (soft-cap or not, mask or not), not per
      // logit: per-logit branches cost more than S = Q K^T.
      const int key0 = item.kv_begin + b * kN;
      if (transform.capped()) {
#pragma unroll
        for (int i = 0; i < kN / 2; ++i) s[i] = transform.cap * transform.Unit(s[i]);
      } else {
#pragma unroll
        for (int i = 0; i < kN / 2; ++i) s[i] *= transform.mul;
      }
      const bool whole = keys[0].begin <= key0 && key0 + kN <= keys[0].end && keys[1].begin <= key0 &&
                         key0 + kN <= keys[1].end;
      if (!__all_sync(0xffffffffu, whole)) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // Key j = key0 + n * 8 + 2 * (lane % 4) + e is seen when
          // begin <= j < end: as offsets from the thread's first key.
          const int lo = keys[h].begin - key0 - 2 * (lane & 3);
          const int hi = keys[h].end - key0 - 2 * (lane & 3);
#pragma unroll
          for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int at = n * 8 + e;
              float& x = s[4 * n + 2 * h + e];
              x = at >= lo && at < hi ? x : -INFINITY;
            }
          }
        }
      }
      float alpha[2], mx2[2];
      bool grow = false;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kN / 8; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * h], s[4 * n + 2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx2[h] = mx;
        grow |= mx > m2[h] + kLazyRescale;
      }
      // The lazy rescale (kernels/sm90): the running maxima move only when
      // some row's block maximum exceeds its own by more than kLazyRescale,
      // for the whole warp at once; P's values then stay below 2^8.
      const bool moved = __any_sync(0xffffffffu, grow);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_new = moved ? fmaxf(m2[h], mx2[h]) : m2[h];
        const bool none = !(m_new > -INFINITY);
        alpha[h] = moved && !none ? Exp2(m2[h] - m_new) : 1.f;
        m2[h] = m_new;
        // A row that saw no key yet has only -inf logits: 2^-inf = 0.
        const float neg_m = none ? 0.f : -m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = Exp2(s[4 * n + 2 * h + e] + neg_m);
            s[4 * n + 2 * h + e] = p;
            sum += p;
          }
        }
        l[h] = l[h] * alpha[h] + sum;
      }
      // P and the factors once the P V of the block before have read them.
      if (b > 0) NamedBarSync(kBarPFree, kThreads);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
#pragma unroll
        for (int n = 0; n < kN / 8; ++n) {
          const uint32_t at = r * 128 + ((n ^ (r & 7)) << 4) + (lane & 3) * 4;
          *reinterpret_cast<uint32_t*>(smem + kOffP + at) = Pack2<T>(s[4 * n + 2 * h], s[4 * n + 2 * h + 1]);
        }
        if ((lane & 3) == 0) s_alpha[b & 1][r] = alpha[h];
      }
      FenceProxyAsync();
      NamedBarSync(kBarPReady, kThreads);
    }
    // The rows' ends: the LSE here, o's scale to warpgroups 1 and 2.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float lt = l[h];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const int r = r0 + 8 * h;
      const int m = item.row_begin + r;
      const bool row = m < rows_total;
      // (A row past the sequence's writes nothing: its scale is never read.)
      const RowEnd end = mla::EndMlaRow(a, seq, item, m, m2[h], lt);
      if ((lane & 3) == 0) {
        s_scale[r] = end.o_scale;
        if (row) mla::WriteMlaLse(a, seq, item, m, r, kM, end);
      }
    }
    NamedBarSync(kBarEnd, kThreads);
    return;
  }

  // ======================= O and the loads =======================
  // Warpgroups 1 and 2: O's columns [half * 256, half * 256 + 256).
  sm90::RegDealloc<kOutRegs>();
  const int half = wg - 1;
  const int t = tid - 128;  // 0 .. kLoaders - 1
  // Key blocks: lane (t % 8) copies chunk t % 8 of each column block of rows
  // t / 8 + 32 p, so that eight lanes read one 128-byte line. Each row's
  // page is read a block ahead (-1: past the chunk's end), so that its
  // latency passes during a P V, not before the copies.
  const char* layer = a.k_cache + int64_t{seq.layer} * a.slots_per_layer * kRowBytes + (t & 7) * 16;
  const int32_t* pages = a.kv_indices + seq.kv_start;
  constexpr int kPasses = kN * 8 / kLoaders;  // rows a thread copies a block
  int32_t page_of[kPasses];
  auto read_pages = [&](int b) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int j = item.kv_begin + b * kN + (t >> 3) + (kLoaders / 8) * p;
      page_of[p] = j < item.kv_end ? __ldg(pages + a.page.Div(j)) : -1;
    }
  };
  auto load_block = [&](int b) {
    const int stage = b % kStages;
    const uint32_t dst = a_k + stage * kTileBytes;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int r = (t >> 3) + (kLoaders / 8) * p;
      const bool valid = page_of[p] >= 0;
      const int64_t slot = int64_t{valid ? page_of[p] : 0} * a.page.d + a.page.Mod(item.kv_begin + b * kN + r);
      const char* src = valid ? layer + slot * kRowBytes : layer;
#pragma unroll
      for (int cb = 0; cb < kColBlocks; ++cb) {
        CpAsync16(dst + TileOff<kN>(r, (t & 7) + 8 * cb), src + 128 * cb, valid);
      }
    }
    CpAsyncArriveNoinc(bar_full(stage));
  };
  if (num_blocks > 0) {
    // Q's tile: packed row r is q's row q_start * heads + row_begin + r
    // (contiguous); rows past the sequence's are zero-filled.
    const char* q0 = static_cast<const char*>(a.q);
    const char* q = q0 + (int64_t{seq.q_start} * heads + item.row_begin) * kRowBytes;
#pragma unroll 6
    for (int i = 0; i < kM * kChunks / kLoaders; ++i) {
      const int idx = t + kLoaders * i;
      const int r = idx / kChunks, c = idx % kChunks;
      const bool valid = item.row_begin + r < rows_total;
      CpAsync16(a_q + TileOff<kM>(r, c), valid ? q + r * kRowBytes + c * 16 : q0, valid);
    }
    CpAsyncArriveNoinc(bars + 8 * kBarQ);
    read_pages(0);
    load_block(0);
    if (num_blocks > 1) {
      read_pages(1);
      load_block(1);
    }
    if (num_blocks > 2) read_pages(2);
  }
  float o[kHalf / 2];
#pragma unroll
  for (int i = 0; i < kHalf / 2; ++i) o[i] = 0.f;
  for (int b = 0; b < num_blocks; ++b) {
    const int stage = b % kStages;
    NamedBarSync(kBarPReady, kThreads);
    // The stage's bytes are complete (warpgroup 0 waited for them); the wait
    // and the fence order them for this warpgroup's wgmma too.
    MbarWait(bar_full(stage), (b / kStages) & 1);
    FenceProxyAsync();
    const float alpha[2] = {s_alpha[b & 1][r0], s_alpha[b & 1][r0 + 8]};
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < kHalf / 8; ++n) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          o[4 * n + 2 * h] *= alpha[h];
          o[4 * n + 2 * h + 1] *= alpha[h];
        }
      }
    }
    // O += P V: A is P (K-major), B the block's rows as they lie (MN-major:
    // N along the 128-byte rows, 64-column blocks kColBlockBytes apart).
    const uint32_t v_at = a_k + stage * kTileBytes + half * (kHalf / 64) * kColBlockBytes;
    FenceRegs(o);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      sm90::WgmmaSSTransB<kHalf, T>(o, MakeDesc(a_p + kk * 32, 16, 1024),
                                    MakeDesc(v_at + kk * 16 * 128, kColBlockBytes, 1024), 1);
    }
    WgmmaCommit();
    WgmmaWait<0>();
    FenceRegs(o);
    // The stage is free once both halves' P V have read it (S of this
    // block ended before P was ready): block b + 2 goes into it.
    MbarArrive(bar_empty(stage));
    if (b + kStages < num_blocks) {
      MbarWait(bar_empty(stage), (b / kStages) & 1);
      load_block(b + kStages);
      if (b + kStages + 1 < num_blocks) read_pages(b + kStages + 1);
    }
    // Waits for warpgroup 0 to come for P.
    if (b + 1 < num_blocks) NamedBarSync(kBarPFree, kThreads);
  }
  CpAsyncWaitAll();
  NamedBarSync(kBarEnd, kThreads);
  const float o_scale[2] = {s_scale[r0], s_scale[r0 + 8]};

  // O (or the chunk's fp32 partial state) of this warpgroup's columns.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    const int m = item.row_begin + r;
    if (m >= rows_total) continue;
    const int col0 = half * kHalf + 2 * (lane & 3);
    if (item.part_slot < 0) {
      T* out = static_cast<T*>(a.o) + (int64_t{seq.q_start} * heads + m) * kDv + col0;
#pragma unroll
      for (int n = 0; n < kHalf / 8; ++n) {
        *reinterpret_cast<uint32_t*>(out + n * 8) =
            Pack2<T>(o[4 * n + 2 * h] * o_scale[h], o[4 * n + 2 * h + 1] * o_scale[h]);
      }
    } else {
      float* part = a.part_o + (int64_t{item.part_slot} * kM + r) * kDv + col0;
#pragma unroll
      for (int n = 0; n < kHalf / 8; ++n) {
        *reinterpret_cast<float2*>(part + n * 8) =
            make_float2(o[4 * n + 2 * h] * o_scale[h], o[4 * n + 2 * h + 1] * o_scale[h]);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) MlaSm90Kernel(const __grid_constant__ Args a) {
#if ATTNSERVE_MLA_SM90_DEVICE
  MlaCta<T>(a);
#else
  // Built for another architecture: PagedMlaSm90 refuses devices other than
  // sm_90, so this body never runs.
  __trap();
#endif
}

template <typename T>
cudaError_t Launch(const Args& a, int32_t num_items, cudaStream_t stream) {
  auto kernel = MlaSm90Kernel<T>;
  // The shared-memory attribute is per device (kernels/per_device.h).
  static PerDeviceOnce configured;
  const cudaError_t err = configured.Run(
      [&] { return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes); });
  if (err != cudaSuccess) return err;
  kernel<<<num_items, kThreads, kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

#undef ATTNSERVE_MLA_SM90_DEVICE

}  // namespace
}  // namespace mla_sm90

int MlaSm90SmemBytes() { return mla_sm90::kSmemBytes; }

bool MlaSm90Runs() {
  // Asked at every launch: the answer is kept per device.
  static PerDeviceFlag runs;
  return runs.Get([] {
    int dev = 0, major = 0, minor = 0, smem = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return major == 9 && minor == 0 && smem >= mla_sm90::kSmemBytes;
  });
}

cudaError_t PagedMlaSm90(const PagedPrefillParams& p, const MlaWorkItem* items, int32_t num_items,
                         float* part_o, float* part_lse, cudaStream_t stream) {
  if (!MlaCudaSupports(p.geo) || !MlaSm90Runs()) return cudaErrorInvalidValue;
  if (num_items == 0) return cudaSuccess;
  const mla::Args a = mla::ArgsOf(p, items, part_o, part_lse);
  if (p.geo.dtype == KvDType::kBf16) return mla_sm90::Launch<__nv_bfloat16>(a, num_items, stream);
  return mla_sm90::Launch<__half>(a, num_items, stream);
}

}  // namespace attnserve
