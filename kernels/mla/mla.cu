// The MLA kernel family: see kernels/mla/mla_cuda.h for the design.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/math.h"
#include "kernels/mla/mla_args.cuh"
#include "kernels/mla/mla_cuda.h"
#include "kernels/mla/mla_sm90.h"
#include "kernels/numerics.cuh"
#include "kernels/per_device.h"
#include "kernels/sm80/mma.cuh"
#include "kernels/variant.h"

namespace attnserve {
namespace mla {
namespace {

using mma::CpAsync16;
using mma::CpAsyncCommit;
using mma::CpAsyncWait;
using mma::LdMatrixX4;
using mma::LdMatrixX4Trans;
using mma::Mma16816;
using mma::SmemAddr;

constexpr int kDqk = kMlaKvLoraRank + kMlaRopeDim;  // 576
constexpr int kDv = kMlaKvLoraRank;                  // 512
constexpr int kRowBytes = kDqk * 2;                  // 1152
constexpr int kChunks = kRowBytes / 16;              // 72 16-byte chunks a row
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;


template <int kM, int kN>
struct Shape {
  static constexpr int kRowGroups = kM / 16;             // warps along rows
  static constexpr int kColSplit = kWarps / kRowGroups;  // warps along O's columns
  static constexpr int kCols = kDv / kColSplit;          // O columns a warp owns
  static constexpr int kOTiles = kCols / 8;
  // S = Q K^T is computed once: warp w takes rows of row group w % kRowGroups
  // (its O rows) and key piece w / kRowGroups, kKeyPieces pieces of kPn keys;
  // warps past the pieces compute no S.
  static constexpr int kKeyPieces = kColSplit < kN / 8 ? kColSplit : kN / 8;
  static constexpr int kPn = kN / kKeyPieces;
  static constexpr int kPTiles = kPn / 8;
  static constexpr int kThreadsPerKey = kThreads / kN;  // threads loading one K row
  static constexpr int kPStride = (kN + 8) * 2;         // P's row bytes (16 of padding)
  static constexpr int kOffK = kM * kRowBytes;
  static constexpr int kOffP = kOffK + 2 * kN * kRowBytes;
  static constexpr int kOffRed = kOffP + kM * kPStride;
  static constexpr int kSmemBytes = kOffRed + kKeyPieces * kM * 4;
  static_assert(kM % 16 == 0 && kWarps % kRowGroups == 0, "tile rows");
  static_assert(kN % 16 == 0 && kThreads % kN == 0, "key block");
  static_assert(kPn % 8 == 0 && (kPn == 8 || kPn % 16 == 0), "key pieces");
  static_assert(kCols % 16 == 0, "columns");
};

// 16 x 32 runs two CTAs an SM (kernels/mla/mla_cuda.h): at most 128 registers.
template <int kM, int kN>
constexpr int kMinCtas = kM == 16 && kN == 32 ? 2 : 1;

template <int kM, int kN, typename T>
__global__ void __launch_bounds__(kThreads, (kMinCtas<kM, kN>)) MlaKernel(Args a) {
  using S = Shape<kM, kN>;
  extern __shared__ __align__(128) char smem[];
  char* const sq = smem;
  char* const sk = smem + S::kOffK;
  char* const sp = smem + S::kOffP;                         // P, kM x kN
  float* const red = reinterpret_cast<float*>(smem + S::kOffRed);  // [piece][row]
  const MlaWorkItem item = a.items[blockIdx.x];
  const PrefillSeq seq = a.seqs[item.seq];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int heads = a.heads;
  const int rows_total = seq.q_len * heads;

  // Q's tile: packed row m is q's row q_start * heads + m.
  const char* q = static_cast<const char*>(a.q);
  for (int i = tid; i < kM * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int m = item.row_begin + r;
    const bool valid = m < rows_total;
    const char* src =
        valid ? q + (int64_t{seq.q_start} * heads + m) * kRowBytes + c * 16 : q;
    CpAsync16(SmemAddr(sq + Swz<kRowBytes>(r, c)), src, valid);
  }
  // K block loads: kThreadsPerKey threads per latent row, one page lookup each.
  const int key_in_block = tid / S::kThreadsPerKey;
  const int first_chunk = tid % S::kThreadsPerKey;
  auto load_k = [&](int stage, int key0) {
    char* dst = sk + stage * kN * kRowBytes;
    const int j = key0 + key_in_block;
    const bool valid = j < item.kv_end;
    const char* row = a.k_cache;
    if (valid) {
      const int page_at = a.page.Div(j);
      const int64_t slot = int64_t{a.kv_indices[seq.kv_start + page_at]} * a.page.d + (j - page_at * a.page.d);
      row += (int64_t{seq.layer} * a.slots_per_layer + slot) * kRowBytes;
    }
    for (int c = first_chunk; c < kChunks; c += S::kThreadsPerKey) {
      CpAsync16(SmemAddr(dst + Swz<kRowBytes>(key_in_block, c)), valid ? row + c * 16 : row,
                valid);
    }
  };
  const int num_blocks = (item.kv_end - item.kv_begin + kN - 1) / kN;
  if (num_blocks > 0) load_k(0, item.kv_begin);
  CpAsyncCommit();

  const int row_group = warp % S::kRowGroups;
  const int col_slice = warp / S::kRowGroups;  // O's columns; the S piece too
  const bool has_s = col_slice < S::kKeyPieces;
  const int row0 = row_group * 16;
  const int piece0 = col_slice * S::kPn;  // the S piece's first key in the block
  // This thread's two rows (r = row0 + lane / 4 and r + 8): their keys,
  // clipped to the chunk.
  KeyRange keys[2];
  for (int h = 0; h < 2; ++h) {
    const int m = item.row_begin + row0 + lane / 4 + 8 * h;
    KeyRange k;
    if (m < rows_total) k = RowKeys(seq, m / heads);
    k.begin = k.begin > item.kv_begin ? k.begin : item.kv_begin;
    k.end = k.end < item.kv_end ? k.end : item.kv_end;
    keys[h] = k;
  }
  const LogitTransform transform = LogitTransform::Of(seq, /*positive_scale=*/false);

  float o[S::kOTiles][4];
#pragma unroll
  for (int t = 0; t < S::kOTiles; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  // Every warp of a row group keeps the same running maximum (each derives
  // it from the same shared piece maxima); l is this warp's piece's share.
  float m2[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};

  for (int b = 0; b < num_blocks; ++b) {
    if (b + 1 < num_blocks) load_k((b + 1) & 1, item.kv_begin + (b + 1) * kN);
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();
    const char* kt = sk + (b & 1) * kN * kRowBytes;
    const int key0 = item.kv_begin + b * kN;

    // S = Q K^T for this warp's 16 rows and its piece's kPn keys.
    float s[S::kPTiles][4];
#pragma unroll
    for (int t = 0; t < S::kPTiles; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
    if (has_s) {
#pragma unroll 2
      for (int ks = 0; ks < kDqk / 16; ks += 2) {
        uint32_t af[2][4];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          LdMatrixX4(af[u], SmemAddr(sq + Swz<kRowBytes>(row0 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                         (ks + u) * 2 + lane / 16)));
        }
        if constexpr (S::kPn == 8) {
          // One n-tile of 8 keys over 32 dims: matrices (keys, dims 8i..8i+7).
          uint32_t bf[4];
          LdMatrixX4(bf, SmemAddr(kt + Swz<kRowBytes>(piece0 + (lane % 8), ks * 2 + lane / 8)));
          Mma16816<T>(s[0], af[0], bf[0], bf[1]);
          Mma16816<T>(s[0], af[1], bf[2], bf[3]);
        } else {
#pragma unroll
          for (int u = 0; u < 2; ++u) {
#pragma unroll
            for (int np = 0; np < S::kPTiles / 2; ++np) {
              uint32_t bf[4];
              LdMatrixX4(bf, SmemAddr(kt + Swz<kRowBytes>(piece0 + np * 16 + (lane % 8) + (lane / 16) * 8,
                                                           (ks + u) * 2 + (lane / 8) % 2)));
              Mma16816<T>(s[2 * np], af[u], bf[0], bf[1]);
              Mma16816<T>(s[2 * np + 1], af[u], bf[2], bf[3]);
            }
          }
        }
      }
      // Logits (base 2) and the mask; the piece's row maxima to shared memory.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int t = 0; t < S::kPTiles; ++t) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = key0 + piece0 + t * 8 + 2 * (lane % 4) + e;
            const bool seen = j >= keys[h].begin && j < keys[h].end;
            const float x = seen ? transform.Log2(s[t][2 * h + e]) : -INFINITY;
            s[t][2 * h + e] = x;
            mx = fmaxf(mx, x);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (lane % 4 == 0) red[col_slice * kM + row0 + lane / 4 + 8 * h] = mx;
      }
    }
    __syncthreads();
    // The block's row maxima, the online softmax's rescale, and P (16-bit)
    // of this warp's piece to shared memory.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + lane / 4 + 8 * h;
      float mx = red[r];
#pragma unroll
      for (int pc = 1; pc < S::kKeyPieces; ++pc) mx = fmaxf(mx, red[pc * kM + r]);
      const float m_new = fmaxf(m2[h], mx);
      const bool none = !(m_new > -INFINITY);
      const float scale = none ? 1.f : Exp2(m2[h] - m_new);
      m2[h] = m_new;
#pragma unroll
      for (int t = 0; t < S::kOTiles; ++t) {
        o[t][2 * h] *= scale;
        o[t][2 * h + 1] *= scale;
      }
      if (has_s) {
        float sum = 0.f;
#pragma unroll
        for (int t = 0; t < S::kPTiles; ++t) {
          const float p0 = none ? 0.f : Exp2(s[t][2 * h] - m_new);
          const float p1 = none ? 0.f : Exp2(s[t][2 * h + 1] - m_new);
          sum += p0 + p1;
          *reinterpret_cast<uint32_t*>(sp + r * S::kPStride +
                                       (piece0 + t * 8 + 2 * (lane % 4)) * 2) = Pack2<T>(p0, p1);
        }
        l[h] = l[h] * scale + sum;  // this thread's columns; summed over the quad at the end
      }
    }
    __syncthreads();
    // O += P V on this warp's columns; V is the block's first kDv columns.
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t pa[4];
      LdMatrixX4(pa, SmemAddr(sp + (row0 + (lane % 16)) * S::kPStride + (kk * 16 + (lane / 16) * 8) * 2));
#pragma unroll
      for (int np = 0; np < S::kOTiles / 2; ++np) {
        const int d0 = col_slice * S::kCols + np * 16;
        uint32_t vb[4];
        LdMatrixX4Trans(vb, SmemAddr(kt + Swz<kRowBytes>(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                          d0 / 8 + lane / 16)));
        Mma16816<T>(o[2 * np], pa, vb[0], vb[1]);
        Mma16816<T>(o[2 * np + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // the stage is loaded again two blocks on; P and the maxima rewritten
  }
  CpAsyncWait<0>();

  // Each row's l: the pieces' shares, summed through shared memory.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float lt = l[h];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    if (has_s && lane % 4 == 0) red[col_slice * kM + row0 + lane / 4 + 8 * h] = lt;
  }
  __syncthreads();
  // The rows' ends: o and the LSE, or the chunk's partial state.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + lane / 4 + 8 * h;
    float lt = 0.f;
#pragma unroll
    for (int pc = 0; pc < S::kKeyPieces; ++pc) lt += red[pc * kM + r];
    const int m = item.row_begin + r;
    if (m >= rows_total) continue;
    const RowEnd end = EndMlaRow(a, seq, item, m, m2[h], lt);
    if (col_slice == 0 && lane % 4 == 0) WriteMlaLse(a, seq, item, m, r, kM, end);
    const int64_t out_row = int64_t{seq.q_start} * heads + m;
    if (item.part_slot < 0) {
      T* out = static_cast<T*>(a.o) + out_row * kDv;
#pragma unroll
      for (int t = 0; t < S::kOTiles; ++t) {
        const int col = col_slice * S::kCols + t * 8 + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(out + col) =
            Pack2<T>(o[t][2 * h] * end.o_scale, o[t][2 * h + 1] * end.o_scale);
      }
    } else {
      float* part = a.part_o + (int64_t{item.part_slot} * kM + r) * kDv;
#pragma unroll
      for (int t = 0; t < S::kOTiles; ++t) {
        const int col = col_slice * S::kCols + t * 8 + 2 * (lane % 4);
        *reinterpret_cast<float2*>(part + col) =
            make_float2(o[t][2 * h] * end.o_scale, o[t][2 * h + 1] * end.o_scale);
      }
    }
  }
}

// One CTA per (split tile, row): the row's chunks merged by their base-2
// LSEs (kernels/merge_states.h's rule); 128 threads, 4 columns each.
template <typename T>
__global__ void __launch_bounds__(128) MlaMergeKernel(Args a, const MlaMergeTile* merges,
                                                      int32_t tile_rows) {
  const MlaMergeTile tile = merges[blockIdx.x];
  const int r = blockIdx.y;
  const PrefillSeq seq = a.seqs[tile.seq];
  const int m = tile.row_begin + r;
  if (m >= seq.q_len * a.heads) return;
  float top = -INFINITY;
  for (int c = 0; c < tile.num_chunks; ++c) {
    top = fmaxf(top, a.part_lse[int64_t{tile.first_slot + c} * tile_rows + r]);
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float total = 0.f;
  if (top > -INFINITY) {
    for (int c = 0; c < tile.num_chunks; ++c) {
      const int64_t slot_row = int64_t{tile.first_slot + c} * tile_rows + r;
      const float w = Exp2(a.part_lse[slot_row] - top);
      total += w;
      const float4 v = *reinterpret_cast<const float4*>(a.part_o + slot_row * kDv + threadIdx.x * 4);
      acc[0] += w * v.x;
      acc[1] += w * v.y;
      acc[2] += w * v.z;
      acc[3] += w * v.w;
    }
  }
  const float inv = total > 0.f ? Div(1.f, total) : 0.f;
  const int64_t out_row = int64_t{seq.q_start} * a.heads + m;
  T* out = static_cast<T*>(a.o) + out_row * kDv + threadIdx.x * 4;
  *reinterpret_cast<uint32_t*>(out) = Pack2<T>(acc[0] * inv, acc[1] * inv);
  *reinterpret_cast<uint32_t*>(out + 2) = Pack2<T>(acc[2] * inv, acc[3] * inv);
  if (threadIdx.x == 0) {
    const float lse2 = total > 0.f ? top + Log2(total) : -INFINITY;
    a.lse[out_row] = seq.lse_base_e ? lse2 * kLn2 : lse2;
  }
}


template <int kM, int kN, typename T>
cudaError_t Launch(const Args& a, int32_t num_items, cudaStream_t stream) {
  using Sh = Shape<kM, kN>;
  auto kernel = MlaKernel<kM, kN, T>;
  // The shared-memory attribute is per device (kernels/per_device.h).
  static PerDeviceOnce configured;
  const cudaError_t err = configured.Run([&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Sh::kSmemBytes);
  });
  if (err != cudaSuccess) return err;
  kernel<<<num_items, kThreads, Sh::kSmemBytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchFor(const Args& a, int32_t tile_rows, int32_t key_block, int32_t num_items,
                      cudaStream_t stream) {
  if (tile_rows == 64 && key_block == 32) return Launch<64, 32, T>(a, num_items, stream);
  if (tile_rows == 16 && key_block == 64) return Launch<16, 64, T>(a, num_items, stream);
  if (tile_rows == 16 && key_block == 32) return Launch<16, 32, T>(a, num_items, stream);
  return cudaErrorInvalidValue;
}

}  // namespace
}  // namespace mla

MlaPlanOptions MlaPlanOptionsForDevice() {
  MlaPlanOptions options;
  int dev = 0, smem = 0, smem_sm = 0, reserved = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    cudaGetLastError();
  }
  // The largest tile the device's shared memory takes, and for batches of
  // at most 16 packed rows a sequence (decode at up to 16 heads, memory-bound)
  // a 16-row tile: 16 x 32 at two CTAs an SM where two fit (more bytes in
  // flight: 3.17 TB/s against 2.87 for 16 x 64 at one on the H200,
  // bench/results/2026-12-02-session14-h200.md), else 16 x 64 where it fits,
  // else 16 x 32 at one.
  // On sm_90 (H100, H200) the large tile is the wgmma kernel's 64 x 64
  // (kernels/mla/mla_sm90.h).
  const bool sm90 = MlaSm90Runs();
  const bool large = smem >= mla::Shape<64, 32>::kSmemBytes;
  const bool long_block = smem >= mla::Shape<16, 64>::kSmemBytes;
  const bool two_small = smem_sm >= 2 * (mla::Shape<16, 32>::kSmemBytes + reserved);
  options.tile_rows = large ? 64 : 16;
  options.key_block = sm90 ? kMlaSm90KeyBlock : large || !long_block ? 32 : 64;
  options.small_tile_rows = large ? 16 : 0;
  options.small_key_block = !two_small && long_block ? 64 : 32;
  options.small_ctas_per_sm = two_small ? 2 : 1;
  options.num_sms = sms > 0 ? sms : 1;
  options.ctas_per_sm = 1;
  return options;
}

int MlaTileSmemBytes(int32_t tile_rows, int32_t key_block) {
  if (tile_rows == kMlaSm90TileRows && key_block == kMlaSm90KeyBlock) return MlaSm90SmemBytes();
  if (tile_rows == 64 && key_block == 32) return mla::Shape<64, 32>::kSmemBytes;
  if (tile_rows == 16 && key_block == 64) return mla::Shape<16, 64>::kSmemBytes;
  if (tile_rows == 16 && key_block == 32) return mla::Shape<16, 32>::kSmemBytes;
  return -1;
}

bool MlaTileRuns(int32_t tile_rows, int32_t key_block) {
  if (tile_rows == kMlaSm90TileRows && key_block == kMlaSm90KeyBlock) return MlaSm90Runs();
  const int bytes = MlaTileSmemBytes(tile_rows, key_block);
  int dev = 0, smem = 0;
  if (bytes < 0 || cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return smem >= bytes;
}

cudaError_t PagedMlaCuda(const PagedPrefillParams& params, int32_t tile_rows, int32_t key_block,
                         const MlaWorkItem* items, int32_t num_items, float* part_o,
                         float* part_lse, cudaStream_t stream) {
  if (!MlaCudaSupports(params.geo)) return cudaErrorInvalidValue;
  if (tile_rows == kMlaSm90TileRows && key_block == kMlaSm90KeyBlock) {
    return PagedMlaSm90(params, items, num_items, part_o, part_lse, stream);
  }
  if (num_items == 0) return cudaSuccess;
  const mla::Args a = mla::ArgsOf(params, items, part_o, part_lse);
  if (params.geo.dtype == KvDType::kBf16) {
    return mla::LaunchFor<__nv_bfloat16>(a, tile_rows, key_block, num_items, stream);
  }
  return mla::LaunchFor<__half>(a, tile_rows, key_block, num_items, stream);
}

cudaError_t MergeMlaCuda(const PagedPrefillParams& params, int32_t tile_rows,
                         const MlaMergeTile* merges, int32_t num_merges, const float* part_o,
                         const float* part_lse, cudaStream_t stream) {
  if (!MlaCudaSupports(params.geo) || tile_rows <= 0) return cudaErrorInvalidValue;
  if (num_merges == 0) return cudaSuccess;
  const mla::Args a =
      mla::ArgsOf(params, nullptr, const_cast<float*>(part_o), const_cast<float*>(part_lse));
  const dim3 grid(static_cast<unsigned>(num_merges), static_cast<unsigned>(tile_rows));
  if (params.geo.dtype == KvDType::kBf16) {
    mla::MlaMergeKernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(a, merges, tile_rows);
  } else {
    mla::MlaMergeKernel<__half><<<grid, 128, 0, stream>>>(a, merges, tile_rows);
  }
  return cudaGetLastError();
}

}  // namespace attnserve
