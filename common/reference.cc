#include "common/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>
#include <utility>

#include "common/dtype.h"

namespace attnserve {
namespace reference {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// One (sequence, query head): every row of the sequence for that head.
void PrefillSeqHead(const KvGeometry& g, const KvRows& kv, const uint16_t* q,
                    const std::vector<int32_t>& kv_indices, const Seq& s, int64_t h,
                    std::vector<double>* o, std::vector<double>* lse, std::vector<double>* lse_bound) {
  // MLA: one KV head; a latent row's first VDim() values are its V.
  const int64_t hq = g.num_qo_heads, d = g.head_dim, dv = g.VDim(), ps = g.page_size;
  const int64_t kv_head = h / (g.num_qo_heads / g.num_kv_heads);
  auto half = [&](uint16_t x) { return static_cast<double>(HalfToFloat(g.dtype, x)); };
  // Element c of a stored K or V row of this head, as its real value.
  const double k_scale = kv.KScale(s.layer, static_cast<int32_t>(kv_head));
  const double v_scale = kv.VScale(s.layer, static_cast<int32_t>(kv_head));
  auto stored = [&](const void* row, int64_t c, double scale) {
    if (g.KvIsFp8()) {
      return Fp8Value(g.kv_fp8, static_cast<const uint8_t*>(row)[kv_head * d + c]) * scale;
    }
    return half(static_cast<const uint16_t*>(row)[kv_head * d + c]);
  };
  // Row i, at position pos(i), sees positions [first(i), last(i)): none
  // after pos (causal), none before pos - window_left (a window).
  auto pos = [&](int64_t i) { return i + s.kv_len - s.q_len + s.causal_shift; };
  auto last = [&](int64_t i) { return s.causal ? std::min(s.kv_len, pos(i) + 1) : s.kv_len; };
  auto first = [&](int64_t i) {
    return std::min(s.kv_len,
                    s.window_left >= 0 ? std::max<int64_t>(0, pos(i) - s.window_left) : 0);
  };
  // K and V of this head at the positions some row sees, [lo, hi), in float64.
  int64_t lo = s.kv_len, hi = 0;
  for (int64_t i = 0; i < s.q_len; ++i) {
    if (first(i) < last(i)) {
      lo = std::min(lo, first(i));
      hi = std::max(hi, last(i));
    }
  }
  std::vector<double> k(std::max<int64_t>(0, hi - lo) * d), v(std::max<int64_t>(0, hi - lo) * dv);
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t slot = int64_t{kv_indices[s.kv_start + j / ps]} * ps + j % ps;
    const void* kr = kv.K(s.layer, slot);
    const void* vr = kv.V(s.layer, slot);
    for (int64_t c = 0; c < d; ++c) k[(j - lo) * d + c] = stored(kr, c, k_scale);
    for (int64_t c = 0; c < dv; ++c) v[(j - lo) * dv + c] = stored(vr, c, v_scale);
  }
  // The head's sink, natural units (-inf: none).
  const double sink = s.sinks != nullptr ? static_cast<double>(s.sinks[h]) : kNegInf;
  std::vector<double> qd(d), logits(s.kv_len);
  for (int64_t i = 0; i < s.q_len; ++i) {
    const int64_t row = s.q_start + i;
    const int64_t begin = first(i), end = last(i);
    if (begin >= end && sink == kNegInf) continue;  // sees nothing: o 0, lse -inf
    for (int64_t c = 0; c < d; ++c) qd[c] = half(q[(row * hq + h) * d + c]);
    if (s.fp8_queries) {
      RoundQueryRowToE4m3(qd.data(), static_cast<int32_t>(d));
      if (lse_bound != nullptr) {
        // The largest sum of |products| of a key the row sees, scaled as its logit.
        double mag = 0;
        for (int64_t j = begin; j < end; ++j) {
          const double* kj = k.data() + (j - lo) * d;
          double sum = 0;
          for (int64_t c = 0; c < d; ++c) sum += std::fabs(qd[c] * kj[c]);
          mag = std::max(mag, sum);
        }
        mag *= std::fabs(s.sm_scale) / (s.lse_base_e ? 1.0 : std::log(2.0));
        (*lse_bound)[row * hq + h] = std::max(kFp8QueryLseBound, kFp8QueryLseSlope * mag);
      }
    }
    double m = sink;
    for (int64_t j = begin; j < end; ++j) {
      // Four partial sums: one chain of dependent adds is bound by the add
      // latency (the GPU tests spend most of their time here).
      const double* kj = k.data() + (j - lo) * d;
      double dot0 = 0, dot1 = 0, dot2 = 0, dot3 = 0;
      int64_t c = 0;
      for (; c + 4 <= d; c += 4) {
        dot0 += qd[c] * kj[c];
        dot1 += qd[c + 1] * kj[c + 1];
        dot2 += qd[c + 2] * kj[c + 2];
        dot3 += qd[c + 3] * kj[c + 3];
      }
      for (; c < d; ++c) dot0 += qd[c] * kj[c];
      double x = ((dot0 + dot1) + (dot2 + dot3)) * s.sm_scale;
      if (s.soft_cap > 0) x = s.soft_cap * std::tanh(x / s.soft_cap);
      logits[j] = x;
      m = std::max(m, x);
    }
    // The denominator: every visible key's e^x and the sink's e^sink.
    double sum = sink == kNegInf ? 0 : std::exp(sink - m);
    double* out = o->data() + (row * hq + h) * dv;
    for (int64_t j = begin; j < end; ++j) {
      const double w = std::exp(logits[j] - m);
      sum += w;
      for (int64_t c = 0; c < dv; ++c) out[c] += w * v[(j - lo) * dv + c];
    }
    for (int64_t c = 0; c < dv; ++c) out[c] /= sum;
    const double lse_e = m + std::log(sum);
    (*lse)[row * hq + h] = s.lse_base_e ? lse_e : lse_e / std::log(2.0);
  }
}

}  // namespace

namespace {

// y rounded to E4M3: normals 1.mmm 2^E (E in [-6, 8]), subnormals m 2^-9;
// a step of 2^(E - 3) in binade E. Magnitudes of 448 or more (where the
// nearest value would be 480, E4M3's NaN pattern) saturate to 448.
double RoundToE4m3(double y) {
  if (std::isnan(y)) return y;
  const double a = std::fabs(y);
  double r = 448.0;
  if (a < 448.0) {
    int k = 0;
    std::frexp(a, &k);  // a = m 2^k, m in [0.5, 1): floor(log2 a) = k - 1
    const double step = std::ldexp(1.0, std::max(k - 1, -6) - 3);
    r = std::nearbyint(a / step) * step;  // the default mode: ties to even
  }
  return std::copysign(r, y);
}

}  // namespace

void RoundQueryRowToE4m3(double* row, int32_t n) {
  double amax = 0;
  for (int32_t i = 0; i < n; ++i) {
    if (std::isfinite(row[i])) amax = std::max(amax, std::fabs(row[i]));
  }
  int e = 0;
  if (amax > 0) {
    int k = 0;
    std::frexp(amax, &k);
    e = std::clamp(7 - (k - 1), -100, 100);
  }
  for (int32_t i = 0; i < n; ++i) row[i] = std::ldexp(RoundToE4m3(std::ldexp(row[i], e)), -e);
}

void RoundQueryRowToE4m3(KvDType dtype, uint16_t* row, int32_t n) {
  std::vector<double> x(n);
  for (int32_t i = 0; i < n; ++i) x[i] = HalfToFloat(dtype, row[i]);
  RoundQueryRowToE4m3(x.data(), n);
  for (int32_t i = 0; i < n; ++i) row[i] = FloatToHalf(dtype, static_cast<float>(x[i]));
}

double Fp8Value(Fp8Format format, uint8_t bits) {
  // (-1)^s x 2^(e - bias) x (1 + m / 2^M) for a normal, 2^(1 - bias) x
  // m / 2^M for a subnormal (e = 0).
  const int exp_bits = format == Fp8Format::kE5m2 ? 5 : 4;
  const int man_bits = 7 - exp_bits;
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int e = (bits >> man_bits) & ((1 << exp_bits) - 1);
  const int m = bits & ((1 << man_bits) - 1);
  const double sign = (bits & 0x80) != 0 ? -1.0 : 1.0;
  const int e_max = (1 << exp_bits) - 1;
  if (format == Fp8Format::kE5m2 && e == e_max) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (format != Fp8Format::kE5m2 && e == e_max && m == (1 << man_bits) - 1) {
    return std::numeric_limits<double>::quiet_NaN();  // E4M3 has no infinities
  }
  const double frac = static_cast<double>(m) / (1 << man_bits);
  if (e == 0) return sign * std::ldexp(frac, 1 - bias);
  return sign * std::ldexp(1.0 + frac, e - bias);
}

void Prefill(const KvGeometry& geo, const KvRows& kv, const uint16_t* q, int64_t total_q,
             const std::vector<int32_t>& kv_indices, const std::vector<Seq>& seqs,
             std::vector<double>* o, std::vector<double>* lse, int threads,
             std::vector<double>* lse_bound) {
  const int64_t hq = geo.num_qo_heads;
  o->assign(total_q * hq * geo.VDim(), 0.0);
  lse->assign(total_q * hq, kNegInf);
  if (lse_bound != nullptr) lse_bound->assign(total_q * hq, kLseBound);
  std::vector<std::pair<size_t, int64_t>> work;  // (sequence, head)
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (int64_t h = 0; h < hq; ++h) work.emplace_back(s, h);
  }
  // Each (sequence, head) writes its own elements of o and lse.
  auto run = [&](size_t begin, size_t step) {
    for (size_t w = begin; w < work.size(); w += step) {
      PrefillSeqHead(geo, kv, q, kv_indices, seqs[work[w].first], work[w].second, o, lse, lse_bound);
    }
  };
  const size_t n = static_cast<size_t>(std::max(1, threads));
  if (n == 1) {
    run(0, 1);
    return;
  }
  std::vector<std::thread> pool;
  for (size_t i = 0; i < n; ++i) pool.emplace_back(run, i, n);
  for (std::thread& t : pool) t.join();
}

void Merge(KvDType dtype, const std::vector<State>& states, int64_t rows, int32_t d,
           bool lse_base_e, std::vector<double>* v, std::vector<double>* lse) {
  v->assign(rows * d, 0.0);
  lse->assign(rows, kNegInf);
  for (int64_t r = 0; r < rows; ++r) {
    double m = kNegInf;
    for (const State& s : states) m = std::max(m, static_cast<double>(s.lse[r]));
    if (m == kNegInf) continue;
    double total = 0;
    double* out = v->data() + r * d;
    for (const State& s : states) {
      const double l = s.lse[r];
      if (l == kNegInf) continue;
      const double w = lse_base_e ? std::exp(l - m) : std::exp2(l - m);
      total += w;
      for (int32_t c = 0; c < d; ++c) out[c] += w * HalfToFloat(dtype, s.v[r * d + c]);
    }
    for (int32_t c = 0; c < d; ++c) out[c] /= total;
    (*lse)[r] = m + (lse_base_e ? std::log(total) : std::log2(total));
  }
}

}  // namespace reference
}  // namespace attnserve
