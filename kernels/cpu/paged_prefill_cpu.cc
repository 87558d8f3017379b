// CPU kernel for paged prefill attention (see paged_prefill.h). The rules of
// attention (the keys a row sees, the soft-cap, how a row ends with a sink)
// come from kernels/variant.h, as in every CUDA family.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/dtype.h"
#include "kernels/fp8.h"
#include "kernels/math.h"
#include "kernels/paged_prefill.h"
#include "kernels/variant.h"

namespace attnserve {
namespace {

// Gathers the K and V rows [keys.begin, keys.end) of one KV head of one
// sequence into float buffers (keys.size(), head_dim) and (keys.size(),
// VDim()), following the page table: only the keys some row of the sequence
// sees, so a 128-key window over a 128k sequence reads 128 keys per row, not
// 128k. MLA's V is the first VDim() values of the same latent row. An FP8
// pool's values come out as they are stored (its scales are applied by the
// caller).
void GatherHead(const PagedPrefillParams& p, const PrefillSeq& seq, int kv_head, KeyRange keys,
                std::vector<float>& k, std::vector<float>& v) {
  const KvGeometry& g = p.geo;
  const int64_t d = g.head_dim;
  const int64_t dv = g.VDim();
  const int32_t n = keys.size();
  k.resize(static_cast<size_t>(n) * d);
  v.resize(static_cast<size_t>(n) * dv);
#pragma omp parallel for schedule(static)
  for (int32_t i = 0; i < n; ++i) {
    const int32_t j = keys.begin + i;
    const int64_t page = p.kv_indices[seq.kv_start + j / g.page_size];
    const int64_t slot = page * g.page_size + j % g.page_size;
    const int64_t offset =
        (seq.layer * g.SlotsPerLayer() + slot) * g.RowElems() + int64_t{kv_head} * d;
    float* kf = k.data() + int64_t{i} * d;
    float* vf = v.data() + int64_t{i} * dv;
    if (g.KvIsFp8()) {
      const auto* kb = static_cast<const uint8_t*>(p.k_cache) + offset;
      const auto* vb = static_cast<const uint8_t*>(p.v_cache) + offset;
      for (int64_t c = 0; c < d; ++c) kf[c] = Fp8ToFloat(g.kv_fp8, kb[c]);
      for (int64_t c = 0; c < dv; ++c) vf[c] = Fp8ToFloat(g.kv_fp8, vb[c]);
    } else {
      HalfToFloatN(g.dtype, static_cast<const uint16_t*>(p.k_cache) + offset, kf, d);
      HalfToFloatN(g.dtype, static_cast<const uint16_t*>(p.v_cache) + offset, vf, dv);
    }
  }
}

// An FP8 pool's scale of (layer, KV head); 1 for a 16-bit pool.
float KvScale(const PagedPrefillParams& p, const float* scales, int32_t layer, int kv_head) {
  if (!p.geo.KvIsFp8() || scales == nullptr) return 1.f;
  return scales[int64_t{layer} * p.geo.num_kv_heads + kv_head];
}

}  // namespace

void PagedPrefillCpu(const PagedPrefillParams& p) {
  const KvGeometry& g = p.geo;
  const int d = g.head_dim;
  const int dv = g.VDim();
  const int group = g.num_qo_heads / g.num_kv_heads;
  const auto* q = static_cast<const uint16_t*>(p.q);
  auto* o = static_cast<uint16_t*>(p.o);
  std::vector<float> k, v;

  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const PrefillSeq& seq = p.seqs[s];
    if (seq.q_len <= 0) continue;
    // The keys any row of the sequence sees: the only ones gathered.
    const KeyRange read = RowsKeys(seq, 0, seq.q_len - 1).read;
    const float* sinks = seq.sink_index >= 0 && p.sinks != nullptr
                             ? p.sinks + int64_t{seq.sink_index} * g.num_qo_heads
                             : nullptr;
    for (int kv_head = 0; kv_head < g.num_kv_heads; ++kv_head) {
      // FP8: K's scale folds into the logit scale, V's into the output.
      const LogitTransform transform = LogitTransform::Of(
          seq, /*positive_scale=*/false, KvScale(p, p.k_scales, seq.layer, kv_head));
      const float v_scale = KvScale(p, p.v_scales, seq.layer, kv_head);
      GatherHead(p, seq, kv_head, read, k, v);
      const int64_t items = int64_t{seq.q_len} * group;
#pragma omp parallel
      {
        std::vector<float> qf(d), logits, acc(dv);
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < items; ++item) {
          const int32_t i = static_cast<int32_t>(item / group);
          const int head = kv_head * group + static_cast<int>(item % group);
          const int64_t row = seq.q_start + i;
          const int64_t q_off = (row * g.num_qo_heads + head) * d;
          const int64_t o_off = (row * g.num_qo_heads + head) * dv;
          const KeyRange keys = RowKeys(seq, i);
          // Base-2 units throughout: logits x * log2(e), the sink likewise.
          const float sink2 = sinks != nullptr ? sinks[head] * kLog2e : -INFINITY;
          float m2 = -std::numeric_limits<float>::infinity();
          float l = 0.f;
          std::fill(acc.begin(), acc.end(), 0.f);
          if (keys.size() > 0) {
            HalfToFloatN(g.dtype, q + q_off, qf.data(), d);
            logits.resize(keys.size());
            for (int32_t j = keys.begin; j < keys.end; ++j) {
              const float* kj = k.data() + int64_t{j - read.begin} * d;
              float dot = 0.f;
              for (int c = 0; c < d; ++c) dot += qf[c] * kj[c];
              const float x2 = transform.Log2(dot);
              logits[j - keys.begin] = x2;
              m2 = std::max(m2, x2);
            }
            for (int32_t j = keys.begin; j < keys.end; ++j) {
              const float w = std::exp2(logits[j - keys.begin] - m2);
              l += w;
              const float* vj = v.data() + int64_t{j - read.begin} * dv;
              for (int c = 0; c < dv; ++c) acc[c] += w * vj[c];
            }
          }
          const RowEnd end = EndRow(m2, l, sink2);
          const float o_scale = end.o_scale * v_scale;
          for (int c = 0; c < dv; ++c) o[o_off + c] = FloatToHalf(g.dtype, acc[c] * o_scale);
          p.lse[row * g.num_qo_heads + head] = seq.lse_base_e ? end.lse2 * kLn2 : end.lse2;
        }
      }
    }
  }
}

}  // namespace attnserve
