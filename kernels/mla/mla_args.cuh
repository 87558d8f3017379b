// What both kernels of the MLA family (kernels/mla/mla.cu, mla_sm90.cu) take
// and how each ends a row: one statement of the launch arguments and of a
// row's sink, o scale and LSE (kernels/variant.h's EndRow).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/fast_div.h"
#include "kernels/math.h"
#include "kernels/paged_prefill.h"
#include "kernels/plan/mla_plan.h"
#include "kernels/variant.h"

namespace attnserve {
namespace mla {

struct Args {
  const void* q;
  void* o;
  float* lse;
  const char* k_cache;
  const int32_t* kv_indices;
  const PrefillSeq* seqs;
  const float* sinks;
  const MlaWorkItem* items;
  float* part_o;
  float* part_lse;
  int64_t slots_per_layer;
  FastDiv page;  // the page size, as a divider of key positions
  int32_t heads;
};

inline Args ArgsOf(const PagedPrefillParams& p, const MlaWorkItem* items, float* part_o, float* part_lse) {
  Args a;
  a.q = p.q;
  a.o = p.o;
  a.lse = p.lse;
  a.k_cache = static_cast<const char*>(p.k_cache);
  a.kv_indices = p.kv_indices;
  a.seqs = p.seqs;
  a.sinks = p.sinks;
  a.items = items;
  a.part_o = part_o;
  a.part_lse = part_lse;
  a.slots_per_layer = p.geo.SlotsPerLayer();
  a.page = FastDiv(p.geo.page_size);
  a.heads = p.geo.num_qo_heads;
  return a;
}

#if defined(__CUDACC__)
// Packed row m of the item's sequence, whose online softmax ended at
// maximum m2 (base 2) and sum l: o's scale and the base-2 LSE, with the
// row's sink where the item is its tile's chunk 0.
__device__ __forceinline__ RowEnd EndMlaRow(const Args& a, const PrefillSeq& seq, const MlaWorkItem& item, int m,
                                            float m2, float l) {
  const bool sinks = item.chunk == 0 && seq.sink_index >= 0 && a.sinks != nullptr;
  const float sink2 = sinks ? a.sinks[int64_t{seq.sink_index} * a.heads + m % a.heads] * kLog2e : -INFINITY;
  return EndRow(m2, l, sink2);
}

// Its LSE: lse (in the sequence's base) for an unsplit item, else the
// chunk's partial LSE (base 2) at row r of its slot of tile_rows rows.
__device__ __forceinline__ void WriteMlaLse(const Args& a, const PrefillSeq& seq, const MlaWorkItem& item, int m,
                                            int r, int tile_rows, const RowEnd& end) {
  if (item.part_slot < 0) {
    a.lse[int64_t{seq.q_start} * a.heads + m] = seq.lse_base_e ? end.lse2 * kLn2 : end.lse2;
  } else {
    a.part_lse[int64_t{item.part_slot} * tile_rows + r] = end.lse2;
  }
}
#endif

}  // namespace mla
}  // namespace attnserve
