// PagedPrefillCpu on FP8 pools (kernels/fp8.h) against the float64 reference
// over the dequantized stored values (common/reference.h), for every
// geometry the server takes (page_size 1..128, head_dim 64/128/256, GQA),
// E4M3 and E5M2, bf16 and fp16 queries, per-head scales, with and without
// the variants: output relative error below 1e-2 and LSE within 1e-3
// (docs/design.md section 3). The data are random and never zero.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/reference.h"
#include "gtest/gtest.h"
#include "kernels/fp8.h"
#include "kernels/paged_prefill.h"
#include "tests/kernels/kernel_test_util.h"

namespace attnserve {
namespace {

using testing_util::RandomNonzeroHalves;
using testing_util::RelNormError;

struct Fp8Case {
  const char* name;
  int32_t page_size;
  int32_t head_dim;
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  Fp8Format format;
  KvDType dtype;
  bool causal;
  bool variants;  // a window, a soft-cap and sinks on some sequences
};

std::ostream& operator<<(std::ostream& os, const Fp8Case& c) { return os << c.name; }

// An FP8 batch: pools of nonzero FP8 values (redrawn until their bytes are
// neither zero nor NaN), (num_layers, num_kv_heads) scales, queries.
struct Fp8Problem {
  KvGeometry geo;
  std::vector<uint8_t> k_pool, v_pool;
  std::vector<float> k_scales, v_scales;
  std::vector<uint16_t> q;
  std::vector<int32_t> kv_indices;
  std::vector<PrefillSeq> seqs;
  std::vector<float> sinks;
  int32_t total_q = 0;
};

std::vector<uint8_t> RandomFp8Pool(std::mt19937_64& gen, const KvGeometry& g,
                                   const std::vector<float>& scales) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<uint8_t> pool(g.PoolBytes());
  for (int64_t i = 0; i < g.PoolElems(); ++i) {
    const int64_t layer = i / g.LayerElems();
    const int64_t head = (i % g.RowElems()) / g.head_dim;
    const float s = scales[layer * g.num_kv_heads + head];
    uint8_t b;
    do {
      b = Fp8Quantize(g.kv_fp8, dist(gen), s);
    } while ((b & 0x7f) == 0 || std::isnan(Fp8ToFloat(g.kv_fp8, b)));
    pool[i] = b;
  }
  return pool;
}

Fp8Problem MakeProblem(std::mt19937_64& gen, const Fp8Case& c) {
  Fp8Problem p;
  KvGeometry& g = p.geo;
  g.num_layers = 2;
  g.page_size = c.page_size;
  g.num_qo_heads = c.num_qo_heads;
  g.num_kv_heads = c.num_kv_heads;
  g.head_dim = c.head_dim;
  g.dtype = c.dtype;
  g.kv_fp8 = c.format;
  const int32_t max_kv = 300;
  g.num_pages = 3 * ((max_kv + c.page_size - 1) / c.page_size) + 2;
  std::uniform_real_distribution<float> scale_dist(0.004f, 0.08f);
  for (int64_t i = 0; i < int64_t{g.num_layers} * g.num_kv_heads; ++i) {
    p.k_scales.push_back(scale_dist(gen));
    p.v_scales.push_back(scale_dist(gen) * 10);
  }
  p.k_pool = RandomFp8Pool(gen, g, p.k_scales);
  p.v_pool = RandomFp8Pool(gen, g, p.v_scales);
  // Sequences: decode rows, a prefill chunk, a long one, and one over the
  // other layer; pages drawn at random (repeats and any order).
  struct Spec {
    int32_t q_len, kv_len, layer;
  };
  const Spec specs[] = {{1, 1, 0}, {1, max_kv, 1}, {17, 40, 0}, {5, 129, 1}, {3, 0, 0}, {8, 3, 0}};
  std::uniform_int_distribution<int32_t> page_dist(0, g.num_pages - 1);
  std::normal_distribution<float> sink_dist(0.f, 2.f);
  int index = 0;
  for (const Spec& sp : specs) {
    PrefillSeq s;
    s.q_start = p.total_q;
    s.q_len = sp.q_len;
    s.kv_start = static_cast<int32_t>(p.kv_indices.size());
    s.kv_len = sp.kv_len;
    s.layer = sp.layer;
    s.sm_scale = 1.f / std::sqrt(static_cast<float>(g.head_dim));
    s.causal = c.causal ? 1 : 0;
    s.lse_base_e = index % 2;
    if (c.variants && index % 3 == 1) {
      s.window_left = 31;
      s.soft_cap = 30.f;
    }
    if (c.variants && index % 2 == 0) {
      s.sink_index = static_cast<int32_t>(p.sinks.size() / g.num_qo_heads);
      for (int32_t h = 0; h < g.num_qo_heads; ++h) p.sinks.push_back(sink_dist(gen));
    }
    const int32_t pages = (sp.kv_len + g.page_size - 1) / g.page_size;
    for (int32_t i = 0; i < pages; ++i) p.kv_indices.push_back(page_dist(gen));
    p.seqs.push_back(s);
    p.total_q += sp.q_len;
    ++index;
  }
  p.q = RandomNonzeroHalves(gen, g.dtype, int64_t{p.total_q} * g.num_qo_heads * g.head_dim);
  return p;
}

void Reference(const Fp8Problem& p, std::vector<double>* o, std::vector<double>* lse) {
  std::vector<reference::Seq> seqs;
  for (const PrefillSeq& s : p.seqs) {
    reference::Seq r;
    r.q_start = s.q_start;
    r.q_len = s.q_len;
    r.kv_start = s.kv_start;
    r.kv_len = s.kv_len;
    r.layer = s.layer;
    r.sm_scale = s.sm_scale;
    r.causal = s.causal != 0;
    r.window_left = s.window_left;
    r.soft_cap = s.soft_cap;
    r.sinks = s.sink_index >= 0 ? p.sinks.data() + int64_t{s.sink_index} * p.geo.num_qo_heads
                                : nullptr;
    r.lse_base_e = s.lse_base_e != 0;
    seqs.push_back(r);
  }
  reference::Prefill(p.geo,
                     reference::HostPools(p.geo, p.k_pool.data(), p.v_pool.data(),
                                          p.k_scales.data(), p.v_scales.data()),
                     p.q.data(), p.total_q, p.kv_indices, seqs, o, lse, 2);
}

struct Result {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

Result RunKernel(const Fp8Problem& p, const float* k_scales, const float* v_scales) {
  Result r;
  r.o.assign(int64_t{p.total_q} * p.geo.num_qo_heads * p.geo.head_dim, 0xFFFF);
  r.lse.assign(int64_t{p.total_q} * p.geo.num_qo_heads, std::nanf(""));
  PagedPrefillParams params;
  params.q = p.q.data();
  params.o = r.o.data();
  params.lse = r.lse.data();
  params.k_cache = p.k_pool.data();
  params.v_cache = p.v_pool.data();
  params.k_scales = k_scales;
  params.v_scales = v_scales;
  params.kv_indices = p.kv_indices.data();
  params.seqs = p.seqs.data();
  params.sinks = p.sinks.empty() ? nullptr : p.sinks.data();
  params.any_soft_cap = AnySoftCap(p.seqs.data(), static_cast<int32_t>(p.seqs.size()));
  params.num_seqs = static_cast<int32_t>(p.seqs.size());
  params.total_q = p.total_q;
  params.geo = p.geo;
  PagedPrefillCpu(params);
  return r;
}

// Largest |lse - ref| over rows the reference finds finite; a row where one
// is -inf and the other not counts as infinitely far.
double LseError(const std::vector<float>& lse, const std::vector<double>& ref) {
  double worst = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref[i]) || std::isinf(lse[i]) || std::isnan(lse[i])) {
      if (!(std::isinf(ref[i]) && std::isinf(lse[i]) && lse[i] < 0)) {
        return std::numeric_limits<double>::infinity();
      }
      continue;
    }
    worst = std::max(worst, std::fabs(lse[i] - ref[i]));
  }
  return worst;
}

class PagedPrefillFp8Test : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(PagedPrefillFp8Test, MatchesTheReferenceOverDequantizedValues) {
  std::mt19937_64 gen(std::hash<std::string>{}(GetParam().name));
  const Fp8Problem p = MakeProblem(gen, GetParam());
  std::vector<double> o_ref, lse_ref;
  Reference(p, &o_ref, &lse_ref);
  const Result r = RunKernel(p, p.k_scales.data(), p.v_scales.data());
  const double o_err = RelNormError(p.geo.dtype, r.o.data(), o_ref.data(),
                                    static_cast<int64_t>(o_ref.size()));
  EXPECT_LT(o_err, 1e-2);
  EXPECT_LT(LseError(r.lse, lse_ref), 1e-3);
}

// The same comparison fails when a scale is not applied: it can tell.
TEST_P(PagedPrefillFp8Test, AScaleLeftOutFailsTheComparison) {
  std::mt19937_64 gen(std::hash<std::string>{}(GetParam().name) + 1);
  const Fp8Problem p = MakeProblem(gen, GetParam());
  std::vector<double> o_ref, lse_ref;
  Reference(p, &o_ref, &lse_ref);
  const Result no_v = RunKernel(p, p.k_scales.data(), nullptr);
  EXPECT_GT(RelNormError(p.geo.dtype, no_v.o.data(), o_ref.data(),
                         static_cast<int64_t>(o_ref.size())),
            1e-2);
  const Result no_k = RunKernel(p, nullptr, p.v_scales.data());
  EXPECT_GT(LseError(no_k.lse, lse_ref), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, PagedPrefillFp8Test,
    ::testing::Values(
        Fp8Case{"Ps1D64G1E4m3Bf16", 1, 64, 4, 4, Fp8Format::kE4m3, KvDType::kBf16, true, false},
        Fp8Case{"Ps16D128G4E4m3Bf16", 16, 128, 8, 2, Fp8Format::kE4m3, KvDType::kBf16, true, true},
        Fp8Case{"Ps128D256G8E4m3Fp16", 128, 256, 8, 1, Fp8Format::kE4m3, KvDType::kFp16, true,
                false},
        Fp8Case{"Ps7D128G2E4m3Fp16NonCausal", 7, 128, 4, 2, Fp8Format::kE4m3, KvDType::kFp16,
                false, true},
        Fp8Case{"Ps16D64G8E5m2Bf16", 16, 64, 8, 1, Fp8Format::kE5m2, KvDType::kBf16, true, true},
        Fp8Case{"Ps1D256G1E5m2Fp16", 1, 256, 2, 2, Fp8Format::kE5m2, KvDType::kFp16, false,
                false},
        Fp8Case{"Ps64D128G4E5m2Bf16", 64, 128, 4, 1, Fp8Format::kE5m2, KvDType::kBf16, true,
                true}),
    [](const ::testing::TestParamInfo<Fp8Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace attnserve
