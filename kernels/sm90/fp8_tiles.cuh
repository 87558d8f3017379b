// The sm90 family on FP8 pools (Traits::kFp8, kernels/sm90/traits.cuh):
// the conversions to fp16, in place in shared memory, of a landed K or V
// block (the converters') and of a warpgroup's rows of a bf16 Q tile (the
// consumers').
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/kv_geometry.h"
#include "kernels/fp8.h"
#include "kernels/fp8_device.cuh"
#include "kernels/numerics.cuh"
#include "kernels/sm90/ptx.cuh"
#include "kernels/sm90/traits.cuh"

namespace attnserve {
namespace sm90 {

// FP8 staging of a K or V block (Traits::kFp8): byte offset of 16-byte chunk
// c of row r (D bytes a row). head_dim 128: 128-byte rows XOR-swizzled as
// the tensor copy engine's 128-byte mode stores them; head_dim 64: dense.
template <int D>
__device__ __forceinline__ uint32_t Fp8Off(int r, int c) {
  return D == 128 ? r * 128 + ((c ^ (r & 7)) << 4) : r * 64 + c * 16;
}

// Rewrites a stage of KB rows in place as the fp16 tile the GEMMs read
// (TileOff): its FP8 bytes (format F8) lie at tile + fp8_at, the upper half
// of the stage, laid out by Fp8Off; t is the converting thread (0 .. 127),
// all of which take part. Each 16-byte chunk of FP8 becomes two 16-byte
// chunks of fp16 (exact); a chunk is read before anything overwrites it:
//  - head_dim 128: row r's fp16 column block 1 overwrites exactly FP8 row
//    r, so the quad that owns the row (r = i * 32 + t / 4, step i of 4)
//    reads all of it (chunks c = t % 4 and c + 4), syncs the warp, then
//    writes fp16 chunks 2c, 2c + 1 of column block 0 and the same of block 1;
//  - head_dim 64: rows 0 .. 63's fp16 rows lie below the FP8 bytes, rows
//    64 .. 127's overwrite other rows' bytes: those are read first, then the
//    128 threads sync (named barrier `bar`), then write.
// A warp's reads and writes touch every bank position equally. The caller
// fences to the async proxy before the GEMMs may read the tile.
template <int D, int KB, int F8>
__device__ __forceinline__ void ConvertFp8Stage(uint32_t tile, uint32_t fp8_at, int t, int bar) {
  static_assert(KB == 128 && (D == 64 || D == 128), "one converting thread per row of a 128-row block");
  // The thread's first read and write (shared window); step i adds 32 rows.
  const int k7 = (t >> 2) & 7;
  const uint32_t rd = tile + fp8_at + (D == 128 ? (t >> 2) * 128 + (((t & 3) ^ k7) << 4) : t * 16);
  const uint32_t wr = tile + (t >> 2) * 128 + ((((t & 3) * 2) ^ k7) << 4);
  // Four FP8 words -> eight fp16 words, stored as fp16 chunks at and at ^ 16.
  auto put = [](uint32_t at, const uint4& v) {
    uint32_t h[8];
    Fp8x4ToHalfRegs<F8>(v.x, h[0], h[1]);
    Fp8x4ToHalfRegs<F8>(v.y, h[2], h[3]);
    Fp8x4ToHalfRegs<F8>(v.z, h[4], h[5]);
    Fp8x4ToHalfRegs<F8>(v.w, h[6], h[7]);
    StShared128(at, make_uint4(h[0], h[1], h[2], h[3]));
    StShared128(at ^ 16, make_uint4(h[4], h[5], h[6], h[7]));
  };
  if constexpr (D == 128) {
    // The two rows of a quarter-warp (r even, r + 1) would read the same
    // four chunk positions (c ^ k7, k7 and k7 ^ 1 permute 0 .. 3 alike):
    // odd rows read their upper half first, so that each read instruction
    // touches eight distinct positions. `par` is the row's parity.
    const uint32_t par = (t >> 2) & 1;
#pragma unroll 2
    for (int i = 0; i < 4; ++i) {
      const uint32_t at = rd + i * 4096;
      const uint4 first = LdShared128(at ^ (par << 6));         // FP8 chunks 4 par .. 4 par + 3
      const uint4 second = LdShared128(at ^ ((par ^ 1) << 6));  // the other half
      __syncwarp();
      put(wr + i * 4096 + par * (KB * 128), first);
      put(wr + i * 4096 + (par ^ 1) * (KB * 128), second);
    }
  } else {
    // FP8 chunk t + 128 k (row t / 4 + 32 k) -> fp16 row t / 4 + 32 k:
    // steps 0 and 1 write below the FP8 bytes.
#pragma unroll
    for (int k = 0; k < 2; ++k) put(wr + k * 4096, LdShared128(rd + k * 2048));
    uint4 in[2];
#pragma unroll
    for (int k = 2; k < 4; ++k) in[k - 2] = LdShared128(rd + k * 2048);
    NamedBarSync(bar, 128);
#pragma unroll
    for (int k = 2; k < 4; ++k) put(wr + k * 4096, in[k - 2]);
  }
}

template <int D, int KB>
__device__ __forceinline__ void ConvertFp8Stage(uint32_t tile, uint32_t fp8_at, int t, int bar, bool e5m2) {
  if (e5m2) {
    ConvertFp8Stage<D, KB, static_cast<int>(Fp8Format::kE5m2)>(tile, fp8_at, t, bar);
  } else {
    ConvertFp8Stage<D, KB, static_cast<int>(Fp8Format::kE4m3)>(tile, fp8_at, t, bar);
  }
}

// A warpgroup's rows of a landed bf16 Q tile (kRows rows from row0, in
// TileOff's layout of Tr::kM rows) in place as fp16 times 2^e per row
// (QHalfExponent of the row's largest finite |q|; a negative scale's sign
// joins the factor); e goes to exps[row]. Each of the warpgroup's 128
// threads rewrites chunk c of rows row0 + r0 + p * Tr::kRowsPerPass (r0 =
// t / Tr::kChunks, c = t % Tr::kChunks, p < kRows / kRowsPerPass); the
// Tr::kChunks consecutive lanes that hold a row reduce its maximum. All
// passes go together (their loads, then their shuffles interleaved, then
// their products), so that each step's latency is paid once.
//
// On the bits: a finite bf16 magnitude orders as its 15-bit integer, so the
// row maximum is an integer maximum of 16-bit pairs, and its exponent field
// E gives QHalfExponent's 14 - ilogb = 141 - E (a subnormal and E = 1 both
// clamp to 100; 0 and magnitudes above 3.0e38, bits 0x7f62 and up, give 0).
// The factor 2^e (|e| <= 100) is a normal bf16, so the product in bf16 is
// exact but where it falls below 2^-126, which fp16 rounds to 0 either way;
// it is then widened and rounded once to fp16. A warp with an infinity or a
// NaN in any of its rows takes the float path (FiniteAbs).
template <typename Tr, int kRows>
__device__ __forceinline__ void QRowsToHalf(uint8_t* q_tile, int8_t* exps, int row0, int r0, int c, bool negative) {
  constexpr int kPasses = kRows / Tr::kRowsPerPass;
  static_assert(kRows % Tr::kRowsPerPass == 0, "whole passes");
  auto umax2 = [](uint32_t a, uint32_t b) {
    uint32_t d;
    asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  };
  auto at = [&](int p) { return q_tile + TileOff<Tr::kM>(row0 + p * Tr::kRowsPerPass + r0, c); };
  uint4 v[kPasses];
  uint32_t m[kPasses];
  bool special = false;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    v[p] = *reinterpret_cast<const uint4*>(at(p));
    constexpr uint32_t kMag = 0x7fff7fffu;
    m[p] = umax2(umax2(v[p].x & kMag, v[p].y & kMag), umax2(v[p].z & kMag, v[p].w & kMag));
  }
#pragma unroll
  for (int o = 1; o < Tr::kChunks; o <<= 1) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) m[p] = umax2(m[p], __shfl_xor_sync(0xffffffffu, m[p], o));
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    m[p] = max(m[p] & 0xffffu, m[p] >> 16);  // the row's largest |q|, bf16 bits
    special |= m[p] >= 0x7f80u;
  }
  int e[kPasses];
  if (!__any_sync(0xffffffffu, special)) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      e[p] = (m[p] == 0u || m[p] >= 0x7f62u) ? 0 : max(-100, min(100, 141 - static_cast<int>(m[p] >> 7)));
    }
  } else {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      float amax = 0.f;
      const uint32_t w[4] = {v[p].x, v[p].y, v[p].z, v[p].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 x = Unpack2<__nv_bfloat16>(w[j]);
        amax = fmaxf(amax, fmaxf(FiniteAbs(x.x), FiniteAbs(x.y)));
      }
#pragma unroll
      for (int o = 1; o < Tr::kChunks; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      e[p] = QHalfExponent(amax);
    }
  }
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const uint32_t f16 = (static_cast<uint32_t>(127 + e[p]) << 7) | (negative ? 0x8000u : 0u);  // +-2^e, bf16
    const uint32_t f = f16 | (f16 << 16);
    auto conv = [&](uint32_t w) {
      uint32_t x;
      asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(x) : "r"(w), "r"(f));
      const float2 y = Unpack2<__nv_bfloat16>(x);
      return Pack2<__half>(y.x, y.y);
    };
    *reinterpret_cast<uint4*>(at(p)) = make_uint4(conv(v[p].x), conv(v[p].y), conv(v[p].z), conv(v[p].w));
    if (c == 0) exps[row0 + p * Tr::kRowsPerPass + r0] = static_cast<int8_t>(e[p]);
  }
}

// FP8 queries (Tr::kFp8Q, head_dim 128): a warpgroup's rows of a landed
// 16-bit Q tile (kRows rows from row0, in TileOff's layout of Tr::kM rows)
// as E4M3 times 2^e per row (QFp8Exponent of the row's largest finite |q|;
// a negative scale's sign joins the factor), rounded to nearest even with
// saturation (cvt.rn.satfinite), written over the tile's first column block:
// row r's 128 bytes at r * 128, 16-byte chunk k at k ^ (r % 8) (the 128-byte
// swizzle the FP8 wgmma's descriptor reads, as K's stored bytes lie). e goes
// to exps[row]. Thread (r0 = t / 16, c = t % 16) holds 16-bit chunk c of its
// rows (8 elements) and writes their 8 bytes, half of E4M3 chunk c / 2. A
// row's 16 lanes are one warp's, and every lane has loaded all its rows
// before the shuffles of the row maxima, so no write lands on a chunk not
// yet read.
template <typename Tr, typename T, int kRows>
__device__ __forceinline__ void QRowsToFp8(uint8_t* q_tile, int8_t* exps, int row0, int r0, int c, bool negative) {
  constexpr int kPasses = kRows / Tr::kRowsPerPass;
  static_assert(Tr::kD == 128 && Tr::kChunks == 16 && kRows % Tr::kRowsPerPass == 0, "head_dim 128, whole passes");
  auto row = [&](int p) { return row0 + p * Tr::kRowsPerPass + r0; };
  uint4 v[kPasses];
  float amax[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    v[p] = *reinterpret_cast<const uint4*>(q_tile + TileOff<Tr::kM>(row(p), c));
    const uint32_t w[4] = {v[p].x, v[p].y, v[p].z, v[p].w};
    float a = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 x = Unpack2<T>(w[j]);
      a = fmaxf(a, fmaxf(FiniteAbs(x.x), FiniteAbs(x.y)));
    }
    amax[p] = a;
  }
#pragma unroll
  for (int o = 1; o < Tr::kChunks; o <<= 1) {
#pragma unroll
    for (int p = 0; p < kPasses; ++p) amax[p] = fmaxf(amax[p], __shfl_xor_sync(0xffffffffu, amax[p], o));
  }
  auto e4m3x2 = [](float lo, float hi) -> uint32_t {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
  };
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int e = QFp8Exponent(amax[p]);
    const float f = __uint_as_float((static_cast<uint32_t>(127 + e) << 23) | (negative ? 0x80000000u : 0u));
    const uint32_t w[4] = {v[p].x, v[p].y, v[p].z, v[p].w};
    uint32_t b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 x = Unpack2<T>(w[j]);
      b[j] = e4m3x2(x.x * f, x.y * f);
    }
    const int r = row(p);
    *reinterpret_cast<uint2*>(q_tile + r * 128 + ((((c >> 1) ^ (r & 7))) << 4) + (c & 1) * 8) =
        make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
    if (c == 0) exps[r] = static_cast<int8_t>(e);
  }
}

}  // namespace sm90
}  // namespace attnserve
