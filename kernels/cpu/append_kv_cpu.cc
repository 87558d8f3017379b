// CPU reference for KV append (scatter by slot) and gather, 16-bit or FP8
// pools (kernels/fp8.h: the one quantizer).
#include <cstring>

#include "common/dtype.h"
#include "kernels/append_kv.h"
#include "kernels/fp8.h"

namespace attnserve {
namespace {

float ScaleAt(const float* scales, int32_t layer, int32_t head, const KvGeometry& g) {
  return scales == nullptr ? 1.f : scales[int64_t{layer} * g.num_kv_heads + head];
}

// One 16-bit row quantized into FP8 bytes, head by head.
void QuantizeRow(const KvGeometry& g, const uint16_t* in, uint8_t* out, const float* scales,
                 int32_t layer) {
  const int32_t d = g.head_dim;
  for (int32_t h = 0; h < g.num_kv_heads; ++h) {
    const float s = ScaleAt(scales, layer, h, g);
    for (int32_t c = 0; c < d; ++c) {
      const int64_t i = int64_t{h} * d + c;
      out[i] = Fp8Quantize(g.kv_fp8, HalfBitsToFloat(g.dtype, in[i]), s);
    }
  }
}

// One stored FP8 row as 16-bit values: each FP8 value times its scale in
// float32, rounded to geo.dtype.
void DequantizeRow(const KvGeometry& g, const uint8_t* in, uint16_t* out, const float* scales,
                   int32_t layer) {
  const int32_t d = g.head_dim;
  for (int32_t h = 0; h < g.num_kv_heads; ++h) {
    const float s = ScaleAt(scales, layer, h, g);
    for (int32_t c = 0; c < d; ++c) {
      const int64_t i = int64_t{h} * d + c;
      out[i] = FloatToHalf(g.dtype, Fp8ToFloat(g.kv_fp8, in[i]) * s);
    }
  }
}

}  // namespace

void AppendKvCpu(const AppendKvParams& p) {
  const KvGeometry& g = p.geo;
  const int64_t stored_row = g.KvRowBytes();
  auto* k_cache = static_cast<uint8_t*>(p.k_cache) + int64_t{p.layer} * g.LayerBytes();
  // MLA: the latent pool alone (no v_cache, no v).
  const bool has_v = g.HasVPool();
  auto* v_cache = has_v ? static_cast<uint8_t*>(p.v_cache) + int64_t{p.layer} * g.LayerBytes()
                        : nullptr;
  const auto* k = static_cast<const uint8_t*>(p.k);
  const auto* v = static_cast<const uint8_t*>(p.v);
  const bool quantize = g.KvIsFp8() && !p.rows_fp8;
  const int64_t in_row = quantize ? g.RowElems() * g.QElemBytes() : stored_row;
  // Serial order: when a slot repeats (the core rejects that), the last row wins.
  for (int64_t i = 0; i < p.n; ++i) {
    uint8_t* k_dst = k_cache + p.slots[i] * stored_row;
    if (quantize) {
      // The rows come from the backend's aligned scratch or the request's
      // own 16-bit-aligned bytes (CpuBackend flattens the others).
      QuantizeRow(g, reinterpret_cast<const uint16_t*>(k + i * in_row), k_dst, p.k_scales,
                  p.layer);
    } else {
      std::memcpy(k_dst, k + i * in_row, static_cast<size_t>(stored_row));
    }
    if (!has_v) continue;
    uint8_t* v_dst = v_cache + p.slots[i] * stored_row;
    if (quantize) {
      QuantizeRow(g, reinterpret_cast<const uint16_t*>(v + i * in_row), v_dst, p.v_scales,
                  p.layer);
    } else {
      std::memcpy(v_dst, v + i * in_row, static_cast<size_t>(stored_row));
    }
  }
}

void GatherKvCpu(const GatherKvParams& p) {
  const KvGeometry& g = p.geo;
  const int64_t stored_row = g.KvRowBytes();
  const auto* k_cache = static_cast<const uint8_t*>(p.k_cache) + int64_t{p.layer} * g.LayerBytes();
  const bool has_v = g.HasVPool();
  const auto* v_cache =
      has_v ? static_cast<const uint8_t*>(p.v_cache) + int64_t{p.layer} * g.LayerBytes() : nullptr;
  auto* k = static_cast<uint8_t*>(p.k);
  auto* v = static_cast<uint8_t*>(p.v);
  const bool dequantize = g.KvIsFp8() && p.dequantize;
  const int64_t out_row = dequantize ? g.RowElems() * g.QElemBytes() : stored_row;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p.n; ++i) {
    const uint8_t* k_src = k_cache + p.slots[i] * stored_row;
    if (dequantize) {
      DequantizeRow(g, k_src, reinterpret_cast<uint16_t*>(k + i * out_row), p.k_scales, p.layer);
    } else {
      std::memcpy(k + i * out_row, k_src, static_cast<size_t>(stored_row));
    }
    if (!has_v) continue;
    const uint8_t* v_src = v_cache + p.slots[i] * stored_row;
    if (dequantize) {
      DequantizeRow(g, v_src, reinterpret_cast<uint16_t*>(v + i * out_row), p.v_scales, p.layer);
    } else {
      std::memcpy(v + i * out_row, v_src, static_cast<size_t>(stored_row));
    }
  }
}

}  // namespace attnserve
