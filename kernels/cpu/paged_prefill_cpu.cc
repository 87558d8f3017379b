// CPU reference for paged prefill attention (see paged_prefill.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/dtype.h"
#include "kernels/math.h"
#include "kernels/paged_prefill.h"

namespace attnserve {
namespace {


// Gathers the K and V rows of one KV head of one sequence into float
// buffers (kv_len, head_dim), following the page table.
void GatherHead(const PagedPrefillParams& p, const PrefillSeq& seq, int kv_head,
                std::vector<float>& k, std::vector<float>& v) {
  const KvGeometry& g = p.geo;
  const int64_t d = g.head_dim;
  k.resize(static_cast<size_t>(seq.kv_len) * d);
  v.resize(static_cast<size_t>(seq.kv_len) * d);
  const auto* k_cache = static_cast<const uint16_t*>(p.k_cache);
  const auto* v_cache = static_cast<const uint16_t*>(p.v_cache);
#pragma omp parallel for schedule(static)
  for (int32_t j = 0; j < seq.kv_len; ++j) {
    const int64_t page = p.kv_indices[seq.kv_start + j / g.page_size];
    const int64_t slot = page * g.page_size + j % g.page_size;
    const int64_t offset =
        (seq.layer * g.SlotsPerLayer() + slot) * g.RowElems() + int64_t{kv_head} * d;
    HalfToFloatN(g.dtype, k_cache + offset, k.data() + j * d, d);
    HalfToFloatN(g.dtype, v_cache + offset, v.data() + j * d, d);
  }
}

}  // namespace

void PagedPrefillCpu(const PagedPrefillParams& p) {
  const KvGeometry& g = p.geo;
  const int d = g.head_dim;
  const int group = g.num_qo_heads / g.num_kv_heads;
  const auto* q = static_cast<const uint16_t*>(p.q);
  auto* o = static_cast<uint16_t*>(p.o);
  std::vector<float> k, v;

  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const PrefillSeq& seq = p.seqs[s];
    if (seq.q_len <= 0) continue;
    for (int kv_head = 0; kv_head < g.num_kv_heads; ++kv_head) {
      GatherHead(p, seq, kv_head, k, v);
      const int64_t items = int64_t{seq.q_len} * group;
#pragma omp parallel
      {
        std::vector<float> qf(d), logits, acc(d);
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < items; ++item) {
          const int32_t i = static_cast<int32_t>(item / group);
          const int head = kv_head * group + static_cast<int>(item % group);
          const int64_t row = seq.q_start + i;
          const int64_t q_off = (row * g.num_qo_heads + head) * d;
          // Causal: row i sees j <= i + kv_len - q_len + causal_shift.
          int64_t visible = seq.kv_len;
          if (seq.causal) {
            visible = std::min<int64_t>(
                visible, int64_t{i} + seq.kv_len - seq.q_len + seq.causal_shift + 1);
          }
          float* out_lse = p.lse + row * g.num_qo_heads + head;
          if (visible <= 0) {
            std::fill(o + q_off, o + q_off + d, FloatToHalf(g.dtype, 0.f));
            *out_lse = -std::numeric_limits<float>::infinity();
            continue;
          }
          HalfToFloatN(g.dtype, q + q_off, qf.data(), d);
          logits.resize(visible);
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < visible; ++j) {
            const float* kj = k.data() + j * d;
            float dot = 0.f;
            for (int c = 0; c < d; ++c) dot += qf[c] * kj[c];
            logits[j] = dot * seq.sm_scale;
            m = std::max(m, logits[j]);
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          float sum = 0.f;
          for (int64_t j = 0; j < visible; ++j) {
            const float w = std::exp(logits[j] - m);
            sum += w;
            const float* vj = v.data() + j * d;
            for (int c = 0; c < d; ++c) acc[c] += w * vj[c];
          }
          const float inv = 1.f / sum;  // sum >= 1: the max term is exp(0)
          for (int c = 0; c < d; ++c) o[q_off + c] = FloatToHalf(g.dtype, acc[c] * inv);
          const float lse_e = m + std::log(sum);
          *out_lse = seq.lse_base_e ? lse_e : lse_e / kLn2;
        }
      }
    }
  }
}

}  // namespace attnserve
