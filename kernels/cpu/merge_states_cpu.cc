// CPU reference for the N-way state merge (see merge_states.h).
#include <cmath>
#include <limits>
#include <vector>

#include "common/dtype.h"
#include "kernels/merge_states.h"

namespace attnserve {

void MergeStatesCpu(const MergeStatesParams& p) {
  const int64_t rows = p.n * p.h;
  const float kNegInf = -std::numeric_limits<float>::infinity();
  auto* v_out = static_cast<uint16_t*>(p.v_out);
#pragma omp parallel
  {
    std::vector<float> acc(p.d), row(p.d), weight(p.num_states);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      float m = kNegInf;
      for (int s = 0; s < p.num_states; ++s) m = std::max(m, p.lse[s][r]);
      uint16_t* out = v_out + r * p.d;
      if (m == kNegInf) {  // nothing seen by any state
        for (int c = 0; c < p.d; ++c) out[c] = FloatToHalf(p.dtype, 0.f);
        p.lse_out[r] = kNegInf;
        continue;
      }
      float total = 0.f;
      for (int s = 0; s < p.num_states; ++s) {
        const float l = p.lse[s][r];
        // A -inf state has weight exactly 0 (exp of -inf).
        weight[s] = p.lse_base_e ? std::exp(l - m) : std::exp2(l - m);
        total += weight[s];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int s = 0; s < p.num_states; ++s) {
        if (weight[s] == 0.f) continue;
        const auto* in = static_cast<const uint16_t*>(p.v[s]) + r * p.d;
        const float w = weight[s] / total;
        float* a = acc.data();
        if (p.dtype == KvDType::kBf16) {  // inline widening: the loop vectorizes
          for (int c = 0; c < p.d; ++c) a[c] += w * Bf16ToFloat(in[c]);
        } else {
          HalfToFloatN(p.dtype, in, row.data(), p.d);
          const float* x = row.data();
          for (int c = 0; c < p.d; ++c) a[c] += w * x[c];
        }
      }
      if (p.dtype == KvDType::kBf16) {
        for (int c = 0; c < p.d; ++c) out[c] = FloatToBf16(acc[c]);
      } else {
        for (int c = 0; c < p.d; ++c) out[c] = FloatToFp16(acc[c]);
      }
      p.lse_out[r] = m + (p.lse_base_e ? std::log(total) : std::log2(total));
    }
  }
}

}  // namespace attnserve
