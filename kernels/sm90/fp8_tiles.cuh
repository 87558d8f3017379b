// The sm90 family on FP8 pools (Traits::kFp8, kernels/sm90/traits.cuh):
// the producer's conversions of a landed K or V block and of a bf16 Q tile
// to fp16, in place in shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/kv_geometry.h"
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

// A landed bf16 Q tile (Tr::kM rows, TileOff) in place as fp16 times 2^e
// per row (QHalfExponent of the row's largest finite |q|, reduced over the
// Tr::kChunks consecutive lanes that hold the row; a negative scale's sign
// joins the factor); e goes to exps[row] for the consumers. Each of the 128
// converting threads rewrites chunk c of rows r0 + p * Tr::kRowsPerPass
// (r0 = t / Tr::kChunks, c = t % Tr::kChunks).
template <typename Tr>
__device__ __forceinline__ void QTileToHalf(uint8_t* q_tile, int8_t* exps, int r0, int c, bool negative) {
#pragma unroll 4
  for (int p = 0; p < Tr::kQPasses; ++p) {
    const int row = p * Tr::kRowsPerPass + r0;
    uint4* ptr = reinterpret_cast<uint4*>(q_tile + TileOff<Tr::kM>(row, c));
    const uint4 v = *ptr;
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    float f[8];
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 x = Unpack2<__nv_bfloat16>(w[j]);
      f[2 * j] = x.x;
      f[2 * j + 1] = x.y;
      amax = fmaxf(amax, fmaxf(FiniteAbs(x.x), FiniteAbs(x.y)));
    }
#pragma unroll
    for (int o = 1; o < Tr::kChunks; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int e = QHalfExponent(amax);
    const float mul = __int_as_float((127 + e) << 23) * (negative ? -1.f : 1.f);
    *ptr = make_uint4(Pack2<__half>(f[0] * mul, f[1] * mul), Pack2<__half>(f[2] * mul, f[3] * mul),
                      Pack2<__half>(f[4] * mul, f[5] * mul), Pack2<__half>(f[6] * mul, f[7] * mul));
    if (c == 0) exps[row] = static_cast<int8_t>(e);
  }
}

}  // namespace sm90
}  // namespace attnserve
