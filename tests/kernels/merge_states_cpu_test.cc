// MergeStatesCpu against the float64 merge of common/reference.h (docs/design.md
// section 3 (FlashInfer paper, section 2.2), N-way, with -inf states, in both
// LSE bases; and split-KV attention merged by LSE equals the unsplit one.
#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/reference.h"
#include "gtest/gtest.h"
#include "kernels/merge_states.h"
#include "kernels/paged_prefill.h"
#include "tests/kernels/kernel_test_util.h"

namespace attnserve {
namespace {

using testing_util::DTypeName;
using testing_util::IsPoisonFloat;
using testing_util::IsPoisonHalf;
using testing_util::kNegInf;
using testing_util::Poison;
using testing_util::RandomNonzeroHalves;
using testing_util::RelNormError;

constexpr float kNegInfF = -std::numeric_limits<float>::infinity();

struct States {
  int64_t n = 0;
  int32_t h = 0, d = 0;
  KvDType dtype = KvDType::kBf16;
  bool lse_base_e = false;
  std::vector<std::vector<uint16_t>> v;  // each (n, h, d)
  std::vector<std::vector<float>> lse;   // each (n, h)
};

struct Merged {
  std::vector<uint16_t> v;  // (n + 1, h, d): one poisoned guard token
  std::vector<float> lse;   // (n + 1, h)
};

Merged RunMerge(const States& s) {
  Merged m;
  m.v.resize((s.n + 1) * s.h * s.d);
  m.lse.resize((s.n + 1) * s.h);
  Poison(m.v);
  Poison(m.lse);
  std::vector<const void*> v_ptrs;
  std::vector<const float*> lse_ptrs;
  for (size_t i = 0; i < s.v.size(); ++i) {
    v_ptrs.push_back(s.v[i].data());
    lse_ptrs.push_back(s.lse[i].data());
  }
  MergeStatesParams p;
  p.v = v_ptrs.data();
  p.lse = lse_ptrs.data();
  p.num_states = static_cast<int32_t>(s.v.size());
  p.v_out = m.v.data();
  p.lse_out = m.lse.data();
  p.n = s.n;
  p.h = s.h;
  p.d = s.d;
  p.dtype = s.dtype;
  p.lse_base_e = s.lse_base_e ? 1 : 0;
  MergeStatesCpu(p);
  return m;
}

// The float64 merge of common/reference.h.
void ReferenceMerge(const States& s, std::vector<double>* v, std::vector<double>* lse) {
  std::vector<reference::State> states;
  for (size_t i = 0; i < s.v.size(); ++i) states.push_back({s.v[i].data(), s.lse[i].data()});
  reference::Merge(s.dtype, states, s.n * s.h, s.d, s.lse_base_e, v, lse);
}

// Compares with docs/design.md's tolerances; returns the rows that were all -inf.
int64_t CheckMerge(const States& s, const Merged& got) {
  std::vector<double> v_ref, lse_ref;
  ReferenceMerge(s, &v_ref, &lse_ref);
  const int64_t rows = s.n * s.h;
  bool guard_intact = true;
  for (int64_t c = rows * s.d; c < (rows + s.h) * s.d; ++c) guard_intact &= IsPoisonHalf(got.v[c]);
  for (int64_t r = rows; r < rows + s.h; ++r) guard_intact &= IsPoisonFloat(got.lse[r]);
  EXPECT_TRUE(guard_intact) << "merge wrote past n";
  EXPECT_LT(RelNormError(s.dtype, got.v.data(), v_ref.data(), rows * s.d), 1e-2);
  int64_t empty_rows = 0;
  int failures = 0;
  for (int64_t r = 0; r < rows && failures < 10; ++r) {
    const uint16_t* o = got.v.data() + r * s.d;
    if (lse_ref[r] == kNegInf) {
      ++empty_rows;
      bool zero = true;
      for (int64_t c = 0; c < s.d; ++c) zero &= HalfToFloat(s.dtype, o[c]) == 0.f;
      if (!(got.lse[r] == kNegInfF) || !zero) {
        ADD_FAILURE() << "row " << r << " has only -inf states: want (0, -inf), got lse "
                      << got.lse[r] << (zero ? "" : " and nonzero v");
        ++failures;
      }
      continue;
    }
    const double rel = RelNormError(s.dtype, o, v_ref.data() + r * s.d, s.d);
    if (!std::isfinite(got.lse[r]) || std::abs(got.lse[r] - lse_ref[r]) >= 1e-3 ||
        !(rel < 2e-2)) {
      ADD_FAILURE() << "row " << r << ": lse " << got.lse[r] << " want " << lse_ref[r]
                    << ", v relative error " << rel;
      ++failures;
    }
  }
  return empty_rows;
}

States RandomStates(std::mt19937_64& gen, int num_states, int64_t n, int32_t h, int32_t d,
                    KvDType dtype, bool lse_base_e, double p_neg_inf) {
  States s;
  s.n = n;
  s.h = h;
  s.d = d;
  s.dtype = dtype;
  s.lse_base_e = lse_base_e;
  std::uniform_real_distribution<float> lse_dist(-20.f, 20.f);
  std::bernoulli_distribution neg_inf(p_neg_inf);
  for (int i = 0; i < num_states; ++i) {
    s.v.push_back(RandomNonzeroHalves(gen, dtype, n * h * d));
    std::vector<float> lse(n * h);
    for (float& l : lse) l = neg_inf(gen) ? kNegInfF : lse_dist(gen);
    s.lse.push_back(std::move(lse));
  }
  return s;
}

struct MergeConfig {
  int num_states;
  int32_t d;
  KvDType dtype;
  bool lse_base_e;
};

void PrintTo(const MergeConfig& c, std::ostream* os) {
  *os << c.num_states << " states, d " << c.d << ", " << DTypeName(c.dtype)
      << (c.lse_base_e ? ", base e" : ", base 2");
}

class MergeStatesNWayTest : public ::testing::TestWithParam<MergeConfig> {};

TEST_P(MergeStatesNWayTest, MatchesFloat64Reference) {
  const MergeConfig& c = GetParam();
  std::mt19937_64 gen(1000 * c.num_states + c.d + (c.lse_base_e ? 7 : 0));
  States s = RandomStates(gen, c.num_states, /*n=*/24, /*h=*/4, c.d, c.dtype, c.lse_base_e, 0.25);
  // Token 0: every state -inf. Token 1: only the last state finite.
  for (auto& l : s.lse) {
    for (int32_t hh = 0; hh < s.h; ++hh) l[hh] = kNegInfF;
  }
  for (size_t i = 0; i + 1 < s.lse.size(); ++i) {
    for (int32_t hh = 0; hh < s.h; ++hh) s.lse[i][s.h + hh] = kNegInfF;
  }
  for (int32_t hh = 0; hh < s.h; ++hh) s.lse.back()[s.h + hh] = 3.f;
  const Merged got = RunMerge(s);
  EXPECT_GE(CheckMerge(s, got), s.h);
  // Token 1 has one live state: its v and lse pass through unchanged.
  for (int32_t hh = 0; hh < s.h; ++hh) {
    EXPECT_NEAR(got.lse[s.h + hh], 3.f, 1e-6);
  }
}

std::string MergeName(const ::testing::TestParamInfo<MergeConfig>& info) {
  const MergeConfig& c = info.param;
  return "N" + std::to_string(c.num_states) + "D" + std::to_string(c.d) + DTypeName(c.dtype) +
         (c.lse_base_e ? "LseE" : "Lse2");
}

INSTANTIATE_TEST_SUITE_P(
    Configs, MergeStatesNWayTest,
    ::testing::Values(MergeConfig{1, 64, KvDType::kBf16, false},
                      MergeConfig{2, 128, KvDType::kBf16, false},
                      MergeConfig{2, 128, KvDType::kFp16, true},
                      MergeConfig{3, 64, KvDType::kFp16, false},
                      MergeConfig{5, 128, KvDType::kBf16, true},
                      MergeConfig{8, 256, KvDType::kFp16, false},
                      MergeConfig{8, 64, KvDType::kBf16, true}),
    MergeName);

// The seed kernel's bug: two -inf states gave NaN (-inf - -inf).
TEST(MergeStatesTest, AllMinusInfGivesZeroAndMinusInfNeverNaN) {
  for (bool base_e : {false, true}) {
    for (int num_states : {1, 2, 4}) {
      std::mt19937_64 gen(num_states);
      States s = RandomStates(gen, num_states, 8, 2, 64, KvDType::kBf16, base_e, 1.0);
      const Merged got = RunMerge(s);
      EXPECT_EQ(CheckMerge(s, got), s.n * s.h);
      for (int64_t r = 0; r < s.n * s.h; ++r) {
        ASSERT_EQ(got.lse[r], kNegInfF);
        for (int64_t c = 0; c < s.d; ++c) ASSERT_EQ(HalfToFloat(s.dtype, got.v[r * s.d + c]), 0.f);
      }
    }
  }
}

// Far-apart LSEs: the smaller state's weight underflows to 0, nothing
// overflows, and the result is the larger state.
TEST(MergeStatesTest, FarApartLsesDoNotOverflow) {
  for (bool base_e : {false, true}) {
    std::mt19937_64 gen(5);
    States s = RandomStates(gen, 2, 4, 2, 64, KvDType::kFp16, base_e, 0.0);
    for (float& l : s.lse[0]) l = 1000.f;
    for (float& l : s.lse[1]) l = -1000.f;
    const Merged got = RunMerge(s);
    CheckMerge(s, got);
    for (int64_t r = 0; r < s.n * s.h; ++r) EXPECT_NEAR(got.lse[r], 1000.f, 1e-3);
    EXPECT_TRUE(std::equal(s.v[0].begin(), s.v[0].end(), got.v.begin()));
  }
}

// Equal LSEs: the output is the mean and the LSE grows by log_base(N).
TEST(MergeStatesTest, EqualLsesAverage) {
  for (bool base_e : {false, true}) {
    std::mt19937_64 gen(6);
    States s = RandomStates(gen, 4, 6, 2, 128, KvDType::kBf16, base_e, 0.0);
    for (auto& lse : s.lse) std::fill(lse.begin(), lse.end(), 2.5f);
    const Merged got = RunMerge(s);
    CheckMerge(s, got);
    const double want = 2.5 + (base_e ? std::log(4.0) : 2.0);
    for (int64_t r = 0; r < s.n * s.h; ++r) EXPECT_NEAR(got.lse[r], want, 1e-5);
  }
}

// Split-KV: attention over a sequence's KV equals the LSE-merge of attention
// over chunks of it (including an empty chunk, whose state is (0, -inf)).
TEST(MergeStatesTest, MergedChunksEqualWholeAttention) {
  for (bool base_e : {false, true}) {
    SCOPED_TRACE(base_e ? "base e" : "base 2");
    std::mt19937_64 gen(base_e ? 31 : 32);
    KvGeometry g;
    g.num_layers = 1;
    g.num_pages = 8;
    g.page_size = 16;
    g.num_qo_heads = 8;
    g.num_kv_heads = 2;
    g.head_dim = 128;
    g.dtype = KvDType::kBf16;
    const std::vector<uint16_t> k_cache = RandomNonzeroHalves(gen, g.dtype, g.PoolElems());
    const std::vector<uint16_t> v_cache = RandomNonzeroHalves(gen, g.dtype, g.PoolElems());
    const int32_t q_len = 9;
    const std::vector<uint16_t> q =
        RandomNonzeroHalves(gen, g.dtype, int64_t{q_len} * g.num_qo_heads * g.head_dim);
    // The whole sequence: pages {6, 0, 3, 5, 1}, 70 tokens (last page 6 of 16).
    const std::vector<int32_t> kv_indices = {6, 0, 3, 5, 1};
    // Sequence 0 is the whole; 1..4 are chunks: pages {6, 0}, {}, {3}, {5, 1}.
    auto seq = [&](int32_t kv_start, int32_t kv_len) {
      PrefillSeq s;
      s.q_start = 0;
      s.q_len = q_len;
      s.kv_start = kv_start;
      s.kv_len = kv_len;
      s.sm_scale = 1.f / std::sqrt(128.f);
      s.causal = 0;
      s.lse_base_e = base_e ? 1 : 0;
      return s;
    };
    const std::vector<PrefillSeq> parts = {seq(0, 70), seq(0, 32), seq(2, 0), seq(2, 16),
                                           seq(3, 22)};
    States chunks;
    chunks.n = q_len;
    chunks.h = g.num_qo_heads;
    chunks.d = g.head_dim;
    chunks.dtype = g.dtype;
    chunks.lse_base_e = base_e;
    std::vector<uint16_t> whole_o;
    std::vector<float> whole_lse;
    for (size_t i = 0; i < parts.size(); ++i) {
      std::vector<uint16_t> o(q.size());
      std::vector<float> lse(int64_t{q_len} * g.num_qo_heads);
      Poison(o);
      Poison(lse);
      PagedPrefillParams p;
      p.q = q.data();
      p.o = o.data();
      p.lse = lse.data();
      p.k_cache = k_cache.data();
      p.v_cache = v_cache.data();
      p.kv_indices = kv_indices.data();
      p.seqs = &parts[i];
      p.num_seqs = 1;
      p.total_q = q_len;
      p.geo = g;
      PagedPrefillCpu(p);
      if (i == 0) {
        whole_o = std::move(o);
        whole_lse = std::move(lse);
      } else {
        chunks.v.push_back(std::move(o));
        chunks.lse.push_back(std::move(lse));
      }
    }
    const Merged merged = RunMerge(chunks);
    EXPECT_EQ(CheckMerge(chunks, merged), 0);
    std::vector<double> whole_ref(whole_o.size());
    for (size_t i = 0; i < whole_o.size(); ++i) whole_ref[i] = HalfToFloat(g.dtype, whole_o[i]);
    EXPECT_LT(RelNormError(g.dtype, merged.v.data(), whole_ref.data(), whole_ref.size()), 1e-2);
    for (size_t r = 0; r < whole_lse.size(); ++r) {
      ASSERT_NEAR(merged.lse[r], whole_lse[r], 1e-3) << "row " << r;
    }
  }
}

}  // namespace
}  // namespace attnserve
