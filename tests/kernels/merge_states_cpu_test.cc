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


// Sinks and merging (docs/design.md, "Variants"): a sequence's keys in three
// contiguous ranges (as the cluster client spreads them over servers), each
// run as a sequence of its own with kv_keys_after (causal_shift), a window
// and a soft-cap. The LSE includes the sink, so merging the ranges' states
// by LSE gives the whole sequence's attention exactly when one state
// carries the sink; the same merge with the sink in every state, or in
// none, fails the comparison with the float64 reference, as it must.
class SinkMergeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 gen(33);
    g_.num_layers = 1;
    g_.num_pages = 8;
    g_.page_size = 16;
    g_.num_qo_heads = 8;
    g_.num_kv_heads = 2;
    g_.head_dim = 64;
    g_.dtype = KvDType::kBf16;
    k_cache_ = RandomNonzeroHalves(gen, g_.dtype, g_.PoolElems());
    v_cache_ = RandomNonzeroHalves(gen, g_.dtype, g_.PoolElems());
    q_ = RandomNonzeroHalves(gen, g_.dtype, int64_t{kQLen} * g_.num_qo_heads * g_.head_dim);
    // Sinks large enough to move every LSE well past the tolerance.
    std::normal_distribution<float> dist(2.f, 0.5f);
    sinks_.resize(g_.num_qo_heads);
    for (float& x : sinks_) x = dist(gen);
  }

  // The whole sequence (70 keys on pages {6, 0, 3, 5, 1}) or its range
  // [begin, end) (page aligned), with the sink or not.
  PrefillSeq Seq(int32_t begin, int32_t end, bool sink) const {
    PrefillSeq s;
    s.q_len = kQLen;
    s.kv_start = begin / g_.page_size;
    s.kv_len = end - begin;
    s.causal_shift = kKvLen - end;
    s.sm_scale = 1.f / 8.f;
    s.window_left = 40;
    s.soft_cap = 3.f;
    s.sink_index = sink ? 0 : -1;
    return s;
  }

  // The float64 reference of the whole sequence.
  void Whole(std::vector<double>* o, std::vector<double>* lse) const {
    const PrefillSeq w = Seq(0, kKvLen, true);
    reference::Seq r;
    r.q_len = w.q_len;
    r.kv_len = w.kv_len;
    r.sm_scale = w.sm_scale;
    r.window_left = w.window_left;
    r.soft_cap = w.soft_cap;
    r.sinks = sinks_.data();
    reference::Prefill(g_, reference::HostPools(g_, k_cache_.data(), v_cache_.data()), q_.data(),
                       kQLen, kIndices, {r}, o, lse);
  }

  // The three ranges' states from the CPU kernel, `sink[i]` saying which
  // carry the sink.
  States Ranges(const bool (&sink)[3]) const {
    const int32_t bounds[] = {0, 32, 48, kKvLen};
    States st;
    st.n = kQLen;
    st.h = g_.num_qo_heads;
    st.d = g_.head_dim;
    st.dtype = g_.dtype;
    for (int i = 0; i < 3; ++i) {
      const PrefillSeq seq = Seq(bounds[i], bounds[i + 1], sink[i]);
      std::vector<uint16_t> o(q_.size());
      std::vector<float> lse(int64_t{kQLen} * g_.num_qo_heads);
      PagedPrefillParams p;
      p.q = q_.data();
      p.o = o.data();
      p.lse = lse.data();
      p.k_cache = k_cache_.data();
      p.v_cache = v_cache_.data();
      p.kv_indices = kIndices.data();
      p.seqs = &seq;
      p.sinks = sinks_.data();
      p.num_seqs = 1;
      p.total_q = kQLen;
      p.geo = g_;
      PagedPrefillCpu(p);
      st.v.push_back(std::move(o));
      st.lse.push_back(std::move(lse));
    }
    return st;
  }

  // Whether `merged` matches the whole sequence's float64 reference within
  // docs/design.md's tolerances.
  bool MatchesWhole(const std::vector<uint16_t>& v, const std::vector<float>& lse) const {
    std::vector<double> o_ref, lse_ref;
    Whole(&o_ref, &lse_ref);
    double lse_err = 0;
    for (size_t r = 0; r < lse_ref.size(); ++r) {
      lse_err = std::max(lse_err, std::abs(lse[r] - lse_ref[r]));
    }
    const double o_err = RelNormError(g_.dtype, v.data(), o_ref.data(), o_ref.size());
    return o_err < 1e-2 && lse_err < 1e-3;
  }

  static constexpr int32_t kQLen = 9;
  static constexpr int32_t kKvLen = 70;
  const std::vector<int32_t> kIndices = {6, 0, 3, 5, 1};
  KvGeometry g_;
  std::vector<uint16_t> k_cache_, v_cache_, q_;
  std::vector<float> sinks_;
};

TEST_F(SinkMergeTest, MergeStatesCountsTheSinkOfExactlyOneState) {
  const bool kFirst[3] = {true, false, false};
  const bool kLast[3] = {false, false, true};
  const bool kAll[3] = {true, true, true};
  const bool kNone[3] = {false, false, false};
  for (const bool(*which)[3] : {&kFirst, &kLast}) {
    const States st = Ranges(*which);
    const Merged m = RunMerge(st);
    EXPECT_TRUE(MatchesWhole(m.v, m.lse)) << "one state carries the sink";
  }
  for (const bool(*which)[3] : {&kAll, &kNone}) {
    const Merged m = RunMerge(Ranges(*which));
    EXPECT_FALSE(MatchesWhole(m.v, m.lse))
        << "the sink in every state or in none must not match the whole sequence";
  }
}

// The float64 reference merges its own range states the same way: with the
// sink in one it equals its whole sequence, with the sink in all it does not.
TEST_F(SinkMergeTest, ReferenceCountsTheSinkOnce) {
  const int32_t bounds[] = {0, 32, 48, kKvLen};
  for (bool every : {false, true}) {
    std::vector<std::vector<uint16_t>> vs(3);
    std::vector<std::vector<float>> lses(3);
    std::vector<reference::State> states;
    for (int i = 0; i < 3; ++i) {
      const PrefillSeq s = Seq(bounds[i], bounds[i + 1], i == 0 || every);
      reference::Seq r;
      r.q_len = s.q_len;
      r.kv_start = s.kv_start;
      r.kv_len = s.kv_len;
      r.causal_shift = s.causal_shift;
      r.sm_scale = s.sm_scale;
      r.window_left = s.window_left;
      r.soft_cap = s.soft_cap;
      r.sinks = s.sink_index >= 0 ? sinks_.data() : nullptr;
      std::vector<double> o, lse;
      reference::Prefill(g_, reference::HostPools(g_, k_cache_.data(), v_cache_.data()),
                         q_.data(), kQLen, kIndices, {r}, &o, &lse);
      for (double x : o) vs[i].push_back(FloatToHalf(g_.dtype, static_cast<float>(x)));
      for (double x : lse) lses[i].push_back(static_cast<float>(x));
      states.push_back({vs[i].data(), lses[i].data()});
    }
    std::vector<double> v, lse;
    reference::Merge(g_.dtype, states, int64_t{kQLen} * g_.num_qo_heads, g_.head_dim, false, &v,
                     &lse);
    std::vector<uint16_t> v_half;
    for (double x : v) v_half.push_back(FloatToHalf(g_.dtype, static_cast<float>(x)));
    const std::vector<float> lse_f(lse.begin(), lse.end());
    EXPECT_EQ(MatchesWhole(v_half, lse_f), !every) << (every ? "sink in every range" : "sink once");
  }
}

}  // namespace
}  // namespace attnserve
