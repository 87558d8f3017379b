// KV append: scatter n rows of K and V into the paged pools by slot
// (slot = page_id * page_size + offset), like vLLM's reshape_and_cache.
// Shared by the CPU reference (AppendKvCpu) and the CUDA kernel.
//
// An FP8 pool (geo.kv_fp8) takes 16-bit rows (geo.dtype), quantized by
// Fp8Quantize (kernels/fp8.h) with the scale of their layer and KV head, or
// rows already in its FP8 format (rows_fp8), stored as they are. A gather
// from it returns the stored bytes, or 16-bit rows (dequantize): each
// element's FP8 value times its scale in float32, rounded to geo.dtype.
#pragma once

#include <cstdint>

#include "common/kv_geometry.h"

namespace attnserve {

struct AppendKvParams {
  void* k_cache = nullptr;          // (num_layers, num_pages, page_size, num_kv_heads, head_dim)
  void* v_cache = nullptr;          // same shape; MLA (no V pool): unused
  const void* k = nullptr;          // (n, num_kv_heads, head_dim)
  const void* v = nullptr;          // (n, num_kv_heads, head_dim); MLA: unused
  const int64_t* slots = nullptr;   // (n), each in [0, num_pages * page_size)
  int64_t n = 0;
  int32_t layer = 0;
  KvGeometry geo;
  // FP8 pools: k and v hold FP8 bytes of geo.kv_fp8 (stored as they are);
  // false: geo.dtype values, quantized with the scales below.
  bool rows_fp8 = false;
  // FP8 pools: (num_layers, num_kv_heads) scales of K and V (the kernel's
  // memory: device pointers for AppendKvCuda); null means 1.0.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
};

void AppendKvCpu(const AppendKvParams& params);

// Gathers n rows of K and V out of the pools by slot (the inverse of
// AppendKv; used by ReadKV). k and v are written (n, num_kv_heads, head_dim);
// MLA (no V pool): k alone.
struct GatherKvParams {
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  const int64_t* slots = nullptr;
  int64_t n = 0;
  int32_t layer = 0;
  KvGeometry geo;
  // FP8 pools: write geo.dtype rows (the stored values times their scales)
  // instead of the stored bytes.
  bool dequantize = false;
  const float* k_scales = nullptr;  // as AppendKvParams'
  const float* v_scales = nullptr;
};

void GatherKvCpu(const GatherKvParams& params);

// Sets every row of `pages` to zero in every layer, K and V (freed pages are
// scrubbed before anyone may allocate them again).
struct ZeroPagesParams {
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const int32_t* pages = nullptr;  // (num_pages_listed) validated page ids
  int64_t num_pages_listed = 0;
  KvGeometry geo;
};

}  // namespace attnserve
