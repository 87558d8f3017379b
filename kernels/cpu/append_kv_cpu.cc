// CPU reference for KV append (scatter by slot) and gather.
#include <cstring>

#include "kernels/append_kv.h"

namespace attnserve {

void AppendKvCpu(const AppendKvParams& p) {
  const int64_t row = p.geo.RowElems();
  const int64_t base = int64_t{p.layer} * p.geo.LayerElems();
  auto* k_cache = static_cast<uint16_t*>(p.k_cache) + base;
  auto* v_cache = static_cast<uint16_t*>(p.v_cache) + base;
  const auto* k = static_cast<const uint16_t*>(p.k);
  const auto* v = static_cast<const uint16_t*>(p.v);
  // Serial order: when a slot repeats (the core rejects that), the last row wins.
  for (int64_t i = 0; i < p.n; ++i) {
    std::memcpy(k_cache + p.slots[i] * row, k + i * row, row * sizeof(uint16_t));
    std::memcpy(v_cache + p.slots[i] * row, v + i * row, row * sizeof(uint16_t));
  }
}

void GatherKvCpu(const GatherKvParams& p) {
  const int64_t row = p.geo.RowElems();
  const int64_t base = int64_t{p.layer} * p.geo.LayerElems();
  const auto* k_cache = static_cast<const uint16_t*>(p.k_cache) + base;
  const auto* v_cache = static_cast<const uint16_t*>(p.v_cache) + base;
  auto* k = static_cast<uint16_t*>(p.k);
  auto* v = static_cast<uint16_t*>(p.v);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p.n; ++i) {
    std::memcpy(k + i * row, k_cache + p.slots[i] * row, row * sizeof(uint16_t));
    std::memcpy(v + i * row, v_cache + p.slots[i] * row, row * sizeof(uint16_t));
  }
}

}  // namespace attnserve
