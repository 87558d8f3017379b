#include "client/workload.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/reference.h"
#include "kernels/fp8.h"

namespace attnserve {

std::vector<uint16_t> RandomHalves(std::mt19937_64& gen, KvDType dtype, int64_t n,
                                   double stddev) {
  std::normal_distribution<float> dist(0.f, static_cast<float>(stddev));
  std::vector<uint16_t> out(n);
  for (auto& x : out) x = FloatToHalf(dtype, dist(gen));
  return out;
}

KvMirror::KvMirror(const KvGeometry& geo)
    : geo_(geo),
      k_scales_(static_cast<size_t>(geo.num_layers) * geo.num_kv_heads, 1.f),
      v_scales_(k_scales_),
      zeros_(static_cast<size_t>(geo.KvRowBytes()), 0) {}

void KvMirror::Write(int32_t layer, absl::Span<const int64_t> slots,
                     absl::Span<const uint16_t> k_rows, absl::Span<const uint16_t> v_rows) {
  const int64_t row = geo_.RowElems();
  const int32_t d = geo_.head_dim;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t key = layer * geo_.SlotsPerLayer() + slots[i];
    for (auto [rows, in, scales] : {std::tuple{&k_, &k_rows, &k_scales_},
                                    std::tuple{&v_, &v_rows, &v_scales_}}) {
      if (rows == &v_ && !geo_.HasVPool()) continue;  // MLA: the latent rows alone
      std::vector<uint8_t>& stored = (*rows)[key];
      stored.resize(static_cast<size_t>(geo_.KvRowBytes()));
      const uint16_t* src = in->data() + i * row;
      if (!geo_.KvIsFp8()) {
        std::memcpy(stored.data(), src, stored.size());
        continue;
      }
      for (int64_t c = 0; c < row; ++c) {
        const float scale = (*scales)[int64_t{layer} * geo_.num_kv_heads + c / d];
        stored[c] = Fp8Quantize(geo_.kv_fp8, HalfToFloat(geo_.dtype, src[c]), scale);
      }
    }
  }
}

void KvMirror::WriteStored(int32_t layer, absl::Span<const int64_t> slots,
                           absl::Span<const uint8_t> k_rows, absl::Span<const uint8_t> v_rows) {
  const int64_t row = geo_.KvRowBytes();
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t key = layer * geo_.SlotsPerLayer() + slots[i];
    k_[key].assign(k_rows.begin() + i * row, k_rows.begin() + (i + 1) * row);
    if (geo_.HasVPool()) v_[key].assign(v_rows.begin() + i * row, v_rows.begin() + (i + 1) * row);
  }
}

void KvMirror::SetScales(int32_t layer, absl::Span<const float> k_scales,
                         absl::Span<const float> v_scales) {
  std::copy(k_scales.begin(), k_scales.end(),
            k_scales_.begin() + int64_t{layer} * geo_.num_kv_heads);
  std::copy(v_scales.begin(), v_scales.end(),
            v_scales_.begin() + int64_t{layer} * geo_.num_kv_heads);
}

const void* KvMirror::Row(const absl::flat_hash_map<int64_t, std::vector<uint8_t>>& rows,
                          int32_t layer, int64_t slot) const {
  auto it = rows.find(layer * geo_.SlotsPerLayer() + slot);
  return it != rows.end() ? it->second.data() : zeros_.data();
}

const void* KvMirror::StoredK(int32_t layer, int64_t slot) const { return Row(k_, layer, slot); }
const void* KvMirror::StoredV(int32_t layer, int64_t slot) const {
  return Row(geo_.HasVPool() ? v_ : k_, layer, slot);  // MLA: V is in the latent row
}
const uint16_t* KvMirror::K(int32_t layer, int64_t slot) const {
  return static_cast<const uint16_t*>(StoredK(layer, slot));
}
const uint16_t* KvMirror::V(int32_t layer, int64_t slot) const {
  return static_cast<const uint16_t*>(StoredV(layer, slot));
}

absl::Status MirrorServerScales(Client& client, KvMirror* mirror) {
  if (!mirror->geometry().KvIsFp8()) return absl::OkStatus();
  auto scales = client.GetKvScales();
  if (!scales.ok()) return scales.status();
  for (const LayerKvScales& l : *scales) mirror->SetScales(l.layer, l.k_scale, l.v_scale);
  return absl::OkStatus();
}

namespace {

// The mirror as the reference's source of K/V rows.
class MirrorRows final : public reference::KvRows {
 public:
  explicit MirrorRows(const KvMirror& kv) : kv_(kv) {}
  const void* K(int32_t layer, int64_t slot) const override { return kv_.StoredK(layer, slot); }
  const void* V(int32_t layer, int64_t slot) const override { return kv_.StoredV(layer, slot); }
  double KScale(int32_t layer, int32_t head) const override {
    return kv_.k_scales()[int64_t{layer} * kv_.geometry().num_kv_heads + head];
  }
  double VScale(int32_t layer, int32_t head) const override {
    return kv_.v_scales()[int64_t{layer} * kv_.geometry().num_kv_heads + head];
  }

 private:
  const KvMirror& kv_;
};

}  // namespace

void ReferencePrefill(const KvMirror& kv, const PrefillInputs& in, std::vector<double>* o,
                      std::vector<double>* lse, int32_t fp8_query_min_rows, std::vector<double>* lse_bound) {
  const KvGeometry& g = kv.geometry();
  const double scale =
      in.sm_scale ? *in.sm_scale : 1.0 / std::sqrt(static_cast<double>(g.head_dim));
  std::vector<reference::Seq> seqs;
  const int64_t batch = static_cast<int64_t>(in.qo_indptr.size()) - 1;
  for (int64_t b = 0; b < batch; ++b) {
    reference::Seq s;
    s.q_start = in.qo_indptr[b];
    s.q_len = in.qo_indptr[b + 1] - in.qo_indptr[b];
    s.kv_start = in.kv_indptr[b];
    const int64_t pages = in.kv_indptr[b + 1] - in.kv_indptr[b];
    const int64_t last = in.kv_last_page_len.empty() ? 1 : in.kv_last_page_len[b];
    s.kv_len = pages == 0 ? 0 : (pages - 1) * g.page_size + last;
    s.layer = in.layer;
    s.sm_scale = scale;
    s.causal = in.causal;
    s.lse_base_e = in.lse_base_e;
    s.causal_shift = in.kv_keys_after.empty() ? 0 : in.kv_keys_after[b];
    s.window_left = in.options.window_left.value_or(-1);
    s.soft_cap = in.options.logits_soft_cap.value_or(0.f);
    const bool sinks = in.apply_sinks.empty() || in.apply_sinks[b] != 0;
    s.sinks = sinks && !in.options.sinks.empty() ? in.options.sinks.data() : nullptr;
    seqs.push_back(s);
  }
  // The queries as the server computes with them.
  for (reference::Seq& s : seqs) s.fp8_queries = fp8_query_min_rows > 0 && s.q_len >= fp8_query_min_rows;
  reference::Prefill(g, MirrorRows(kv), in.q.data(), in.total_q(), in.kv_indices, seqs, o, lse,
                     /*threads=*/1, lse_bound);
}

PrefillArgs ArgsOf(const PrefillInputs& in) {
  PrefillArgs a;
  a.layer = in.layer;
  a.q = in.q;
  a.qo_indptr = in.qo_indptr;
  a.kv_indptr = in.kv_indptr;
  a.kv_indices = in.kv_indices;
  a.kv_last_page_len = in.kv_last_page_len;
  a.sm_scale = in.sm_scale;
  a.causal = in.causal;
  a.lse_base_e = in.lse_base_e;
  a.kv_keys_after = in.kv_keys_after;
  a.options = in.options;
  a.apply_sinks = in.apply_sinks;
  return a;
}

std::vector<float> RandomSinks(std::mt19937_64& gen, int32_t n) {
  const float kNegInf = -std::numeric_limits<float>::infinity();
  switch (std::uniform_int_distribution<int>(0, 3)(gen)) {
    case 0: return std::vector<float>(n, kNegInf);
    case 1: return std::vector<float>(n, 0.f);
    // Dominates the denominator, yet leaves outputs (about e^-8 of V's) that
    // fp16 still represents.
    case 2: return std::vector<float>(n, 8.f);
    default: break;
  }
  std::normal_distribution<float> dist(0.f, 2.f);
  std::vector<float> sinks(n);
  for (float& x : sinks) x = std::bernoulli_distribution(0.2)(gen) ? kNegInf : dist(gen);
  return sinks;
}

AttentionOptions RandomOptions(std::mt19937_64& gen, const KvGeometry& geo, int32_t max_kv_len) {
  AttentionOptions o;
  auto coin = [&gen] { return std::bernoulli_distribution(0.5)(gen); };
  if (coin()) {
    const int32_t windows[] = {-1, 0, 1, std::max(0, geo.page_size - 1), 63, 64, 127, 128,
                               max_kv_len + 1000};
    const size_t n = sizeof(windows) / sizeof(windows[0]);
    const size_t pick = std::uniform_int_distribution<size_t>(0, n)(gen);
    o.window_left = pick < n ? windows[pick]
                             : std::uniform_int_distribution<int32_t>(0, max_kv_len)(gen);
  }
  if (coin()) {
    const float caps[] = {0.f, 1.f, 5.f, 30.f, 50.f};
    o.logits_soft_cap = caps[std::uniform_int_distribution<int>(0, 4)(gen)];
  }
  if (coin()) o.sinks = RandomSinks(gen, geo.num_qo_heads);
  return o;
}

std::vector<int64_t> SlotsOfPages(const KvGeometry& geo, absl::Span<const int32_t> pages) {
  std::vector<int64_t> slots;
  slots.reserve(pages.size() * geo.page_size);
  for (int32_t p : pages) {
    for (int32_t o = 0; o < geo.page_size; ++o) slots.push_back(int64_t{p} * geo.page_size + o);
  }
  return slots;
}

int64_t PagesNeeded(const KvGeometry& geo, const WorkloadSpec& spec) {
  return int64_t{spec.batch} * ((spec.max_kv_len + geo.page_size - 1) / geo.page_size);
}

PrefillInputs RandomPrefill(std::mt19937_64& gen, const KvGeometry& geo, const WorkloadSpec& spec,
                            absl::Span<const int32_t> pages) {
  PrefillInputs in;
  in.layer = spec.layer;
  in.causal = spec.causal;
  in.lse_base_e = spec.lse_base_e;
  std::vector<int32_t> shuffled(pages.begin(), pages.end());
  std::shuffle(shuffled.begin(), shuffled.end(), gen);
  std::uniform_int_distribution<int32_t> q_dist(0, spec.max_q_len);
  std::uniform_int_distribution<int32_t> kv_dist(0, spec.max_kv_len);
  in.qo_indptr.push_back(0);
  in.kv_indptr.push_back(0);
  size_t next_page = 0;
  for (int32_t b = 0; b < spec.batch; ++b) {
    const int32_t q_len = q_dist(gen);
    const int32_t kv_len = kv_dist(gen);
    const int32_t num_pages = (kv_len + geo.page_size - 1) / geo.page_size;
    // Past the last page the ids start over (a page may appear twice).
    for (int32_t p = 0; p < num_pages && !shuffled.empty(); ++p) {
      in.kv_indices.push_back(shuffled[next_page++ % shuffled.size()]);
    }
    in.qo_indptr.push_back(in.qo_indptr.back() + q_len);
    in.kv_indptr.push_back(in.kv_indptr.back() + num_pages);
    in.kv_last_page_len.push_back(num_pages == 0 ? 0 : kv_len - (num_pages - 1) * geo.page_size);
  }
  in.q = RandomHalves(gen, geo.dtype, in.total_q() * geo.num_qo_heads * geo.head_dim);
  if (spec.variants) in.options = RandomOptions(gen, geo, spec.max_kv_len);
  return in;
}

bool Comparison::Ok(KvDType) const {
  return nan_count == 0 && inf_mismatches == 0 && o_rel_error < 1e-2 && lse_over_bound == 0;
}

std::string Comparison::ToString() const {
  std::string s = absl::StrFormat("o_rel_error=%.3g lse_max_abs_error=%.3g inf_mismatches=%d nan=%d",
                                  o_rel_error, lse_max_abs, inf_mismatches, nan_count);
  if (lse_over_bound > 0) absl::StrAppend(&s, absl::StrFormat(" lse_rows_over_bound=%d", lse_over_bound));
  return s;
}

Comparison Compare(KvDType dtype, absl::Span<const double> o_ref, absl::Span<const double> lse_ref,
                   absl::Span<const uint16_t> o, absl::Span<const float> lse,
                   absl::Span<const double> lse_bound) {
  Comparison c;
  if (o.size() != o_ref.size() || lse.size() != lse_ref.size() ||
      (!lse_bound.empty() && lse_bound.size() != lse_ref.size())) {
    c.nan_count = -1;
    c.o_rel_error = std::numeric_limits<double>::infinity();
    return c;
  }
  double diff = 0, norm = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    const double x = HalfToFloat(dtype, o[i]);
    if (std::isnan(x)) ++c.nan_count;
    diff += (x - o_ref[i]) * (x - o_ref[i]);
    norm += o_ref[i] * o_ref[i];
  }
  c.o_rel_error = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isnan(lse[i])) {
      ++c.nan_count;
      continue;
    }
    const bool ref_inf = std::isinf(lse_ref[i]);
    const bool got_inf = std::isinf(lse[i]) && lse[i] < 0;
    if (ref_inf != got_inf) {
      ++c.inf_mismatches;
      continue;
    }
    if (ref_inf) continue;
    const double err = std::abs(lse[i] - lse_ref[i]);
    c.lse_max_abs = std::max(c.lse_max_abs, err);
    if (!(err < (lse_bound.empty() ? reference::kLseBound : lse_bound[i]))) ++c.lse_over_bound;
  }
  return c;
}

}  // namespace attnserve
