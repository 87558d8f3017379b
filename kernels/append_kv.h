// KV append: scatter n rows of K and V into the paged pools by slot
// (slot = page_id * page_size + offset), like vLLM's reshape_and_cache.
// Shared by the CPU reference (AppendKvCpu) and the CUDA kernel.
#pragma once

#include <cstdint>

#include "common/kv_geometry.h"

namespace attnserve {

struct AppendKvParams {
  void* k_cache = nullptr;          // (num_layers, num_pages, page_size, num_kv_heads, head_dim)
  void* v_cache = nullptr;          // same shape
  const void* k = nullptr;          // (n, num_kv_heads, head_dim)
  const void* v = nullptr;          // (n, num_kv_heads, head_dim)
  const int64_t* slots = nullptr;   // (n), each in [0, num_pages * page_size)
  int64_t n = 0;
  int32_t layer = 0;
  KvGeometry geo;
};

void AppendKvCpu(const AppendKvParams& params);

// Gathers n rows of K and V out of the pools by slot (the inverse of
// AppendKv; used by ReadKV). k and v are written (n, num_kv_heads, head_dim).
struct GatherKvParams {
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  const int64_t* slots = nullptr;
  int64_t n = 0;
  int32_t layer = 0;
  KvGeometry geo;
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
