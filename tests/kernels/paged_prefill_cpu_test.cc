// PagedPrefillCpu and AppendKvCpu / GatherKvCpu against the float64 reference
// of common/reference.h (docs/design.md section 3): GQA, bottom-right causal
// mask, base-2 LSE by default, output 0 and LSE -inf for a row that sees
// nothing; and the conformance suite of the variants (docs/design.md,
// "Variants": sliding windows, soft-caps, sinks) over page sizes, head
// dimensions and dtypes.
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "client/workload.h"
#include "common/dtype.h"
#include "common/reference.h"
#include "gtest/gtest.h"
#include "kernels/append_kv.h"
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

// One sequence of a test batch. `pages` empty: drawn at random (with
// replacement, so ids repeat and come in any order).
struct SeqSpec {
  int32_t q_len = 0;
  int32_t kv_len = 0;
  int32_t layer = 0;
  float sm_scale = 0.f;
  bool causal = true;
  bool lse_base_e = false;
  int32_t causal_shift = 0;
  int32_t window_left = -1;
  float soft_cap = 0.f;
  std::vector<float> sinks;  // (num_qo_heads) or empty: none
  std::vector<int32_t> pages;
};

// A whole kernel input: pools, queries and the ragged batch.
struct Problem {
  KvGeometry geo;
  std::vector<uint16_t> k_cache, v_cache;  // (num_layers, num_pages, page_size, Hkv, D)
  std::vector<uint16_t> q;                 // (total_q, Hq, D)
  std::vector<int32_t> kv_indices;
  std::vector<PrefillSeq> seqs;
  std::vector<float> sinks;  // (sink sets, Hq): set seqs[i].sink_index
  int32_t total_q = 0;
};

int32_t PagesFor(int32_t kv_len, int32_t page_size) {
  return (kv_len + page_size - 1) / page_size;
}

Problem MakeProblem(std::mt19937_64& gen, const KvGeometry& geo,
                    const std::vector<SeqSpec>& specs) {
  Problem p;
  p.geo = geo;
  p.k_cache = RandomNonzeroHalves(gen, geo.dtype, geo.PoolElems());
  // MLA: the latent pool alone.
  if (geo.HasVPool()) p.v_cache = RandomNonzeroHalves(gen, geo.dtype, geo.PoolElems());
  std::uniform_int_distribution<int32_t> page_dist(0, geo.num_pages - 1);
  for (const SeqSpec& s : specs) {
    PrefillSeq seq;
    seq.q_start = p.total_q;
    seq.q_len = s.q_len;
    seq.kv_start = static_cast<int32_t>(p.kv_indices.size());
    seq.kv_len = s.kv_len;
    seq.layer = s.layer;
    seq.sm_scale = s.sm_scale;
    seq.causal = s.causal ? 1 : 0;
    seq.lse_base_e = s.lse_base_e ? 1 : 0;
    seq.causal_shift = s.causal_shift;
    seq.window_left = s.window_left;
    seq.soft_cap = s.soft_cap;
    if (!s.sinks.empty()) {
      EXPECT_EQ(static_cast<int32_t>(s.sinks.size()), geo.num_qo_heads);
      seq.sink_index = static_cast<int32_t>(p.sinks.size() / geo.num_qo_heads);
      p.sinks.insert(p.sinks.end(), s.sinks.begin(), s.sinks.end());
    }
    const int32_t num_pages = PagesFor(s.kv_len, geo.page_size);
    if (!s.pages.empty()) {
      EXPECT_EQ(static_cast<int32_t>(s.pages.size()), num_pages);
      p.kv_indices.insert(p.kv_indices.end(), s.pages.begin(), s.pages.end());
    } else {
      for (int32_t i = 0; i < num_pages; ++i) p.kv_indices.push_back(page_dist(gen));
    }
    p.seqs.push_back(seq);
    p.total_q += s.q_len;
  }
  p.q = RandomNonzeroHalves(gen, geo.dtype,
                            int64_t{p.total_q} * geo.num_qo_heads * geo.head_dim);
  return p;
}

// The float64 reference of common/reference.h on the problem's pools.
void Reference(const Problem& p, std::vector<double>* o, std::vector<double>* lse) {
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
    r.causal_shift = s.causal_shift;
    r.window_left = s.window_left;
    r.soft_cap = s.soft_cap;
    r.sinks = s.sink_index >= 0 ? p.sinks.data() + int64_t{s.sink_index} * p.geo.num_qo_heads
                                : nullptr;
    r.lse_base_e = s.lse_base_e != 0;
    seqs.push_back(r);
  }
  reference::Prefill(p.geo, reference::HostPools(p.geo, p.k_cache.data(), p.v_cache.data()),
                     p.q.data(), p.total_q, p.kv_indices, seqs, o, lse);
}

// What a run produced: outputs with one poisoned guard row past the end.
struct Output {
  std::vector<uint16_t> o;  // (total_q + 1, Hq, D)
  std::vector<float> lse;   // (total_q + 1, Hq)
};

Output RunKernel(const Problem& p) {
  const KvGeometry& g = p.geo;
  Output out;
  out.o.resize(int64_t{p.total_q + 1} * g.ORowElems());
  out.lse.resize(int64_t{p.total_q + 1} * g.num_qo_heads);
  Poison(out.o);
  Poison(out.lse);
  PagedPrefillParams params;
  params.q = p.q.data();
  params.o = out.o.data();
  params.lse = out.lse.data();
  params.k_cache = p.k_cache.data();
  params.v_cache = g.HasVPool() ? p.v_cache.data() : p.k_cache.data();
  params.kv_indices = p.kv_indices.data();
  params.seqs = p.seqs.data();
  params.sinks = p.sinks.empty() ? nullptr : p.sinks.data();
  params.num_seqs = static_cast<int32_t>(p.seqs.size());
  params.total_q = p.total_q;
  params.geo = g;
  PagedPrefillCpu(params);
  return out;
}

// Counts of the edge cases a problem exercised, so that a test can prove it
// covered what it claims.
struct Coverage {
  int64_t blind_rows = 0;       // (row, head) pairs that see nothing and have no sink
  int64_t sink_only_rows = 0;   // pairs that see no key but have a sink: o 0, LSE the sink
  int64_t seen_rows = 0;
};

// Checks a run against the reference with docs/design.md's tolerances; returns
// what was covered.
Coverage CheckAgainstReference(const Problem& p, const Output& out) {
  const KvGeometry& g = p.geo;
  const int64_t hq = g.num_qo_heads, d = g.VDim();  // the output's width
  std::vector<double> o_ref, lse_ref;
  Reference(p, &o_ref, &lse_ref);
  Coverage cov;

  // Nothing written past total_q.
  bool guard_intact = true;
  for (int64_t c = 0; c < hq * d; ++c) {
    guard_intact &= IsPoisonHalf(out.o[int64_t{p.total_q} * hq * d + c]);
  }
  for (int64_t h = 0; h < hq; ++h) {
    guard_intact &= IsPoisonFloat(out.lse[int64_t{p.total_q} * hq + h]);
  }
  EXPECT_TRUE(guard_intact) << "o or lse written past total_q";

  const int64_t n_o = int64_t{p.total_q} * hq * d;
  const double rel = RelNormError(g.dtype, out.o.data(), o_ref.data(), n_o);
  EXPECT_LT(rel, 1e-2) << "relative norm error of o over the whole tensor";

  int failures = 0;
  for (int64_t r = 0; r < int64_t{p.total_q} * hq && failures < 10; ++r) {
    const float got = out.lse[r];
    const uint16_t* o_row = out.o.data() + r * d;
    if (lse_ref[r] == kNegInf) {
      ++cov.blind_rows;
      bool zero = true;
      for (int64_t c = 0; c < d; ++c) zero &= HalfToFloat(g.dtype, o_row[c]) == 0.f;
      if (!(got == -std::numeric_limits<float>::infinity()) || !zero) {
        ADD_FAILURE() << "row " << r / hq << " head " << r % hq
                      << " sees nothing: want o = 0 and lse = -inf, got lse " << got
                      << (zero ? "" : " and nonzero o");
        ++failures;
      }
      continue;
    }
    bool ref_zero = true;
    for (int64_t c = 0; c < d; ++c) ref_zero &= o_ref[r * d + c] == 0.0;
    if (ref_zero) {  // no key, a sink: o exactly 0, LSE the sink's logit
      ++cov.sink_only_rows;
      bool zero = true;
      for (int64_t c = 0; c < d; ++c) zero &= HalfToFloat(g.dtype, o_row[c]) == 0.f;
      if (!zero || !(std::abs(got - lse_ref[r]) < 1e-3)) {
        ADD_FAILURE() << "row " << r / hq << " head " << r % hq
                      << " sees only its sink: want o = 0 and lse " << lse_ref[r] << ", got lse "
                      << got << (zero ? "" : " and nonzero o");
        ++failures;
      }
      continue;
    }
    ++cov.seen_rows;
    const double row_rel = RelNormError(g.dtype, o_row, o_ref.data() + r * d, d);
    if (!std::isfinite(got) || std::abs(got - lse_ref[r]) >= 1e-3 || !(row_rel < 2e-2)) {
      ADD_FAILURE() << "row " << r / hq << " head " << r % hq << ": lse " << got << " want "
                    << lse_ref[r] << ", o row relative error " << row_rel;
      ++failures;
    }
  }
  return cov;
}

// ------------------------------------------------------------ random configs

enum class Mode { kOn, kOff, kMixed };

struct Config {
  std::string name;
  int32_t page_size;
  int32_t head_dim;
  int32_t num_qo_heads;
  int32_t num_kv_heads;
  KvDType dtype;
  Mode causal;
  Mode lse_base_e;
  int32_t num_layers;
  int32_t random_seqs;  // besides the forced edge cases
  int32_t max_q_len;
  int32_t max_kv_len;
  // > 0: MLA (num_kv_heads 1; head_dim is kv_lora_rank + qk_rope_head_dim).
  int32_t kv_lora_rank = 0;
  int32_t qk_rope_head_dim = 0;
};

std::string ConfigName(const ::testing::TestParamInfo<Config>& info) { return info.param.name; }
void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

bool Draw(std::mt19937_64& gen, Mode mode) {
  if (mode == Mode::kMixed) return std::bernoulli_distribution(0.5)(gen);
  return mode == Mode::kOn;
}

// Forced edge cases plus random sequences, shuffled.
std::vector<SeqSpec> MakeSpecs(std::mt19937_64& gen, const Config& c) {
  const int32_t ps = c.page_size;
  std::uniform_int_distribution<int32_t> q_dist(1, c.max_q_len);
  std::uniform_int_distribution<int32_t> kv_dist(1, c.max_kv_len);
  std::vector<SeqSpec> specs;
  auto add = [&](int32_t q_len, int32_t kv_len) {
    SeqSpec s;
    s.q_len = q_len;
    s.kv_len = kv_len;
    specs.push_back(s);
  };
  add(0, kv_dist(gen));   // no query rows
  add(q_dist(gen), 0);    // no pages: every row sees nothing
  add(0, 0);              // nothing at all
  // More rows than KV tokens: under the causal mask the first rows see nothing.
  // kv_len is made a partial last page where page_size allows.
  {
    int32_t kv = std::max(1, std::min(c.max_kv_len, ps + ps / 2 + 1));
    add(kv + 1 + q_dist(gen) % 8, kv);
  }
  add(q_dist(gen), std::max(1, c.max_kv_len / ps) * ps);  // exactly full last page
  add(1, kv_dist(gen));                                   // a decode row
  add(c.max_q_len, c.max_q_len);                          // square causal block
  for (int32_t i = 0; i < c.random_seqs; ++i) add(q_dist(gen), kv_dist(gen));
  std::shuffle(specs.begin(), specs.end(), gen);
  std::uniform_int_distribution<int32_t> layer_dist(0, c.num_layers - 1);
  std::uniform_real_distribution<float> scale_dist(0.5f, 1.5f);
  for (SeqSpec& s : specs) {
    s.layer = layer_dist(gen);
    s.sm_scale = scale_dist(gen) / std::sqrt(static_cast<float>(c.head_dim));
    s.causal = Draw(gen, c.causal);
    s.lse_base_e = Draw(gen, c.lse_base_e);
  }
  return specs;
}

class PagedPrefillRandomTest : public ::testing::TestWithParam<Config> {};

TEST_P(PagedPrefillRandomTest, MatchesFloat64Reference) {
  const Config& c = GetParam();
  std::mt19937_64 gen(std::hash<std::string>()(c.name));
  const std::vector<SeqSpec> specs = MakeSpecs(gen, c);
  int64_t pages_needed = 0;
  for (const SeqSpec& s : specs) pages_needed += PagesFor(s.kv_len, c.page_size);
  KvGeometry geo;
  geo.num_layers = c.num_layers;
  // Fewer pages than the batch needs: ids repeat within and across sequences.
  geo.num_pages = static_cast<int32_t>(std::max<int64_t>(4, pages_needed * 2 / 3));
  geo.page_size = c.page_size;
  geo.num_qo_heads = c.num_qo_heads;
  geo.num_kv_heads = c.num_kv_heads;
  geo.head_dim = c.head_dim;
  geo.dtype = c.dtype;
  if (c.kv_lora_rank > 0) {
    geo.attention = AttentionKind::kMla;
    geo.kv_lora_rank = c.kv_lora_rank;
    geo.qk_rope_head_dim = c.qk_rope_head_dim;
    ASSERT_EQ(c.head_dim, c.kv_lora_rank + c.qk_rope_head_dim);
    ASSERT_EQ(c.num_kv_heads, 1);
  }
  const Problem p = MakeProblem(gen, geo, specs);
  const Output out = RunKernel(p);
  const Coverage cov = CheckAgainstReference(p, out);
  // The forced edge cases guarantee rows that see nothing and rows that see KV.
  EXPECT_GT(cov.blind_rows, 0);
  EXPECT_GT(cov.seen_rows, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, PagedPrefillRandomTest,
    ::testing::Values(
        // page_size 1, the FlashInfer-Bench definition's shape (32 x 128, GQA 8).
        Config{"Ps1H32Kv4D128Bf16Causal", 1, 128, 32, 4, KvDType::kBf16, Mode::kOn, Mode::kOff,
               2, 3, 40, 160},
        Config{"Ps16H32Kv4D128Bf16Causal", 16, 128, 32, 4, KvDType::kBf16, Mode::kOn, Mode::kOff,
               2, 3, 40, 200},
        // GQA group 1, 4 and 8 at page_size 1 and 16.
        Config{"Ps1Group1D128Bf16", 1, 128, 4, 4, KvDType::kBf16, Mode::kOn, Mode::kOff, 3, 6,
               48, 200},
        Config{"Ps1Group4D64Fp16LseE", 1, 64, 8, 2, KvDType::kFp16, Mode::kOn, Mode::kOn, 3, 6,
               48, 200},
        Config{"Ps1Group8D128Fp16NonCausal", 1, 128, 8, 1, KvDType::kFp16, Mode::kOff,
               Mode::kOff, 2, 5, 48, 150},
        Config{"Ps16Group1D64Fp16", 16, 64, 4, 4, KvDType::kFp16, Mode::kOn, Mode::kOff, 3, 6,
               48, 300},
        Config{"Ps16Group4D128Bf16LseE", 16, 128, 8, 2, KvDType::kBf16, Mode::kOn, Mode::kOn, 3,
               6, 48, 300},
        Config{"Ps16Group8D64Bf16NonCausal", 16, 64, 8, 1, KvDType::kBf16, Mode::kOff,
               Mode::kOff, 3, 6, 48, 300},
        // head_dim 256 in both dtypes.
        Config{"Ps16Group2D256Bf16", 16, 256, 4, 2, KvDType::kBf16, Mode::kOn, Mode::kOff, 2, 4,
               32, 200},
        Config{"Ps1Group4D256Fp16LseE", 1, 256, 4, 1, KvDType::kFp16, Mode::kOn, Mode::kOn, 2, 4,
               32, 120},
        // page_size 128: many partial last pages and sequences inside one page.
        Config{"Ps128Group4D64Bf16", 128, 64, 8, 2, KvDType::kBf16, Mode::kOn, Mode::kOff, 2, 4,
               48, 400},
        Config{"Ps128Group1D128Fp16NonCausalLseE", 128, 128, 4, 4, KvDType::kFp16, Mode::kOff,
               Mode::kOn, 2, 4, 48, 300},
        // Every per-sequence setting mixed inside one batch: layers, scales,
        // masks and LSE bases.
        Config{"Ps16MixedEverything", 16, 128, 8, 2, KvDType::kBf16, Mode::kMixed, Mode::kMixed,
               4, 10, 48, 250},
        Config{"Ps1MixedEverythingFp16", 1, 64, 8, 1, KvDType::kFp16, Mode::kMixed,
               Mode::kMixed, 4, 10, 32, 120},
        // MLA: DeepSeek V3's latent rows (512 + 64; 16 heads, as under
        // tensor parallelism) at FlashMLA's page size, and small ones at
        // page_size 1 with every per-sequence setting mixed.
        Config{"MlaPs64H16R512P64Bf16", 64, 576, 16, 1, KvDType::kBf16, Mode::kOn, Mode::kOff, 2,
               3, 24, 300, 512, 64},
        Config{"MlaPs1H8R64P16Fp16Mixed", 1, 80, 8, 1, KvDType::kFp16, Mode::kMixed, Mode::kMixed,
               3, 6, 32, 120, 64, 16},
        Config{"MlaPs16H4R128P0Bf16", 16, 128, 4, 1, KvDType::kBf16, Mode::kOn, Mode::kOn, 2, 4,
               32, 160, 128, 0}),
    ConfigName);

// ------------------------------------------------------------ hand-made cases

KvGeometry SmallGeometry(int32_t page_size, KvDType dtype = KvDType::kBf16) {
  KvGeometry g;
  g.num_layers = 2;
  g.num_pages = 8;
  g.page_size = page_size;
  g.num_qo_heads = 8;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.dtype = dtype;
  return g;
}

SeqSpec Seq(int32_t q_len, int32_t kv_len, std::vector<int32_t> pages = {}, int32_t layer = 0) {
  SeqSpec s;
  s.q_len = q_len;
  s.kv_len = kv_len;
  s.layer = layer;
  s.sm_scale = 1.f / 8.f;
  s.pages = std::move(pages);
  return s;
}

// Page ids out of order and repeated, within one sequence and across two.
TEST(PagedPrefillTest, PagesOutOfOrderAndRepeated) {
  std::mt19937_64 gen(11);
  const KvGeometry geo = SmallGeometry(4);
  const Problem p = MakeProblem(
      gen, geo, {Seq(5, 15, {6, 1, 6, 0}), Seq(7, 9, {1, 7, 1}, 1), Seq(3, 4, {6})});
  CheckAgainstReference(p, RunKernel(p));
}

// With q_len > kv_len under the causal mask exactly the first q_len - kv_len
// rows see nothing; the rest see 1, 2, ... positions.
TEST(PagedPrefillTest, CausalRowsBeforeTheKvSeeNothing) {
  std::mt19937_64 gen(12);
  const KvGeometry geo = SmallGeometry(16);
  const Problem p = MakeProblem(gen, geo, {Seq(10, 3, {2})});
  const Output out = RunKernel(p);
  const Coverage cov = CheckAgainstReference(p, out);
  EXPECT_EQ(cov.blind_rows, 7 * geo.num_qo_heads);
  // Row 7 sees exactly position 0: its output is V[0] of its KV head (rounded).
  const int64_t d = geo.head_dim;
  for (int32_t h = 0; h < geo.num_qo_heads; ++h) {
    const int32_t kv_head = h / (geo.num_qo_heads / geo.num_kv_heads);
    const uint16_t* v0 = p.v_cache.data() + (int64_t{2} * geo.page_size * 2 + kv_head) * d;
    for (int64_t c = 0; c < d; ++c) {
      ASSERT_EQ(out.o[(int64_t{7} * geo.num_qo_heads + h) * d + c], v0[c]) << "head " << h;
    }
    EXPECT_TRUE(std::isfinite(out.lse[7 * geo.num_qo_heads + h]));
  }
}

// Non-causal, the same rows see every position (nothing is blind).
TEST(PagedPrefillTest, NonCausalRowsSeeEverything) {
  std::mt19937_64 gen(13);
  const KvGeometry geo = SmallGeometry(16);
  std::vector<SeqSpec> specs = {Seq(10, 3, {2}), Seq(4, 40, {5, 3, 0})};
  for (SeqSpec& s : specs) s.causal = false;
  const Problem p = MakeProblem(gen, geo, specs);
  const Coverage cov = CheckAgainstReference(p, RunKernel(p));
  EXPECT_EQ(cov.blind_rows, 0);
}

// causal_shift moves the diagonal: row i sees j <= i + kv_len - q_len +
// causal_shift. Negative shifts blind the first rows, positive ones show
// more; each sequence has its own.
TEST(PagedPrefillTest, CausalShiftMovesTheDiagonal) {
  std::mt19937_64 gen(21);
  const KvGeometry geo = SmallGeometry(16);
  std::vector<SeqSpec> specs = {Seq(12, 20, {1, 4}), Seq(12, 20, {1, 4}), Seq(12, 20, {1, 4}),
                                Seq(5, 40, {0, 2, 6})};
  Problem p = MakeProblem(gen, geo, specs);
  const int32_t shifts[] = {0, -12, 3, -38};
  for (size_t i = 0; i < p.seqs.size(); ++i) p.seqs[i].causal_shift = shifts[i];
  const Coverage cov = CheckAgainstReference(p, RunKernel(p));
  // Shift -12 at q_len 12, kv_len 20: rows 0..3 see nothing; shift -38 at
  // q_len 5, kv_len 40: rows 0..2 see nothing.
  EXPECT_EQ(cov.blind_rows, (4 + 3) * geo.num_qo_heads);
}

// A batch of only empty sequences and sequences without pages.
TEST(PagedPrefillTest, OnlyEmptySequences) {
  std::mt19937_64 gen(14);
  const KvGeometry geo = SmallGeometry(1, KvDType::kFp16);
  std::vector<SeqSpec> specs = {Seq(0, 0), Seq(3, 0), Seq(0, 5, {1, 2, 3, 4, 5}), Seq(2, 0)};
  specs[3].causal = false;
  const Problem p = MakeProblem(gen, geo, specs);
  const Coverage cov = CheckAgainstReference(p, RunKernel(p));
  EXPECT_EQ(cov.blind_rows, 5 * geo.num_qo_heads);
  EXPECT_EQ(cov.seen_rows, 0);
}

// The same sequence in both LSE bases: LSE_e = LSE_2 * ln 2, same output.
TEST(PagedPrefillTest, LseBasesAgree) {
  std::mt19937_64 gen(15);
  const KvGeometry geo = SmallGeometry(16);
  std::vector<SeqSpec> specs = {Seq(9, 30, {4, 7}), Seq(9, 30, {4, 7})};
  specs[1].lse_base_e = true;
  Problem p = MakeProblem(gen, geo, specs);
  // Both sequences get the same queries.
  const int64_t row = int64_t{geo.num_qo_heads} * geo.head_dim;
  std::copy(p.q.begin(), p.q.begin() + 9 * row, p.q.begin() + 9 * row);
  const Output out = RunKernel(p);
  CheckAgainstReference(p, out);
  for (int64_t r = 0; r < 9 * geo.num_qo_heads; ++r) {
    EXPECT_NEAR(out.lse[r] * std::log(2.0), out.lse[9 * geo.num_qo_heads + r], 1e-4);
  }
  EXPECT_TRUE(std::equal(out.o.begin(), out.o.begin() + 9 * row, out.o.begin() + 9 * row));
}

// Same data in two layers' pages gives different results: the kernel reads
// the layer each sequence names.
TEST(PagedPrefillTest, EachSequenceReadsItsLayer) {
  std::mt19937_64 gen(16);
  KvGeometry geo = SmallGeometry(16);
  geo.num_layers = 3;
  const Problem p = MakeProblem(gen, geo, {Seq(6, 20, {3, 1}, 2), Seq(6, 20, {3, 1}, 0)});
  CheckAgainstReference(p, RunKernel(p));
}

// Large logits (a big sm_scale) must not overflow: the max is subtracted.
TEST(PagedPrefillTest, LargeLogitsStayFinite) {
  std::mt19937_64 gen(17);
  const KvGeometry geo = SmallGeometry(16);
  std::vector<SeqSpec> specs = {Seq(8, 40, {0, 1, 2})};
  specs[0].sm_scale = 30.f;
  const Problem p = MakeProblem(gen, geo, specs);
  CheckAgainstReference(p, RunKernel(p));
}

// Soft-caps and scales at the ends of their ranges over keys whose dot
// product is exactly 0 (a zero K row in every page): scale / c overflows
// float32 for a tiny cap or a huge scale, which made those logits 0 x inf =
// NaN and the whole row NaN. The multiplier is now kept finite, and the
// rows match the reference (a uniform softmax for the tiny caps, where every
// logit is within c of 0).
TEST(PagedPrefillTest, ExtremeSoftCapsAndScalesOverZeroDotProducts) {
  std::mt19937_64 gen(20261205);
  const KvGeometry geo = SmallGeometry(16);
  std::vector<SeqSpec> specs;
  for (const reference::ScaleAndCap& c : reference::kExtremeScalesAndCaps) {
    specs.push_back(Seq(5, 40, {0, 1, 2}));
    specs.back().sm_scale = c.sm_scale;
    specs.back().soft_cap = c.soft_cap;
  }
  Problem p = MakeProblem(gen, geo, specs);
  // Row 3 of every page of layer 0 is zero in K: its dot products are 0.
  const int64_t row = int64_t{geo.num_kv_heads} * geo.head_dim;
  for (int32_t page = 0; page < geo.num_pages; ++page) {
    const int64_t at = (int64_t{page} * geo.page_size + 3) * row;
    std::fill(p.k_cache.begin() + at, p.k_cache.begin() + at + row, uint16_t{0});
  }
  CheckAgainstReference(p, RunKernel(p));
}

// ------------------------------------------------------------ variants

// The variant conformance suite (docs/design.md, "Variants"): for each page
// size x head_dim x dtype, one batch holding a sequence for every case
// (windows of 0, 1, a page, a kernel block, larger than the sequence, with
// kv_keys_after, causal or not; soft-caps with positive and negative scales;
// sinks of -inf, 0, large and mixed; rows that see nothing, with and without
// a sink), plus sequences with options drawn by client/workload.h's
// RandomOptions (which tests/gpu draws from too), against the float64
// reference. Small sizes: the CPU is slow.
struct VariantConfig {
  std::string name;
  int32_t page_size;
  int32_t head_dim;
  KvDType dtype;
  // > 0: MLA with this latent width (the rest of head_dim is the rope part).
  int32_t kv_lora_rank = 0;
};

std::string VariantName(const ::testing::TestParamInfo<VariantConfig>& info) {
  return info.param.name;
}
void PrintTo(const VariantConfig& c, std::ostream* os) { *os << c.name; }

std::vector<SeqSpec> VariantCases(std::mt19937_64& gen, const KvGeometry& geo) {
  const int32_t hq = geo.num_qo_heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(geo.head_dim));
  const float kInf = std::numeric_limits<float>::infinity();
  std::vector<SeqSpec> specs;
  auto add = [&](int32_t q_len, int32_t kv_len, int32_t window, bool causal = true,
                 int32_t shift = 0) -> SeqSpec& {
    SeqSpec s;
    s.q_len = q_len;
    s.kv_len = kv_len;
    s.window_left = window;
    s.causal = causal;
    s.causal_shift = shift;
    s.sm_scale = scale;
    specs.push_back(s);
    return specs.back();
  };
  // Windows, causal: nothing but the diagonal, one more, a page of keys, a
  // kernel block of keys (64 and 128, and one more), larger than the sequence.
  add(20, 150, 0);
  add(20, 150, 1);
  add(20, 150, geo.page_size - 1);
  add(12, 160, 63);
  add(12, 160, 64);
  add(12, 200, 127);
  add(12, 200, 128);
  add(20, 60, 500);
  // Windows with kv_keys_after (a range of a longer sequence): rows see the
  // range's end; far enough after it, nothing at all.
  add(12, 40, 16, true, 10);
  add(12, 40, 16, true, 30);   // every row's window lies past the range: blind
  // Not causal: the window is a left bound only (and kv_keys_after moves it).
  add(16, 90, 10, false);
  add(16, 90, 10, false, 25);
  add(16, 90, 0, false, 200);  // past the range: blind
  // Soft-caps, with positive and negative scales (a cap of 1 bends every
  // logit, 50 hardly any).
  add(16, 100, -1).soft_cap = 1.f;
  SeqSpec& neg_cap = add(16, 100, -1);
  neg_cap.soft_cap = 5.f;
  neg_cap.sm_scale = -1.5f * scale;
  SeqSpec& neg_cap_window = add(16, 100, 32);
  neg_cap_window.soft_cap = 50.f;
  neg_cap_window.sm_scale = -scale;
  add(16, 100, -1).sm_scale = -2.f * scale;  // a negative scale alone
  // Sinks: -inf (none), 0, large, mixed per head.
  add(10, 70, -1).sinks.assign(hq, -kInf);
  add(10, 70, -1).sinks.assign(hq, 0.f);
  // Large: the outputs shrink to e^-sink of V's; fp16 represents e^-8 of
  // them, bf16 (fp32's exponent) far smaller.
  add(10, 70, 8).sinks.assign(hq, geo.dtype == KvDType::kFp16 ? 8.f : 25.f);
  add(10, 70, -1).sinks = RandomSinks(gen, hq);
  // Rows that see nothing: more rows than keys (causal), no keys at all, a
  // window past the range; each with and without a sink.
  add(12, 5, -1);
  add(12, 5, -1).sinks = RandomSinks(gen, hq);
  {
    SeqSpec& s = add(12, 5, 2);
    s.sinks.assign(hq, 1.5f);
    s.lse_base_e = true;
  }
  add(4, 0, -1).sinks.assign(hq, -0.5f);
  add(6, 30, 3, true, 40).sinks.assign(hq, 3.f);
  // Everything at once, in both LSE bases.
  for (bool base_e : {false, true}) {
    SeqSpec& s = add(14, 120, 20, true, 7);
    s.soft_cap = 2.f;
    s.sinks = RandomSinks(gen, hq);
    s.lse_base_e = base_e;
  }
  // Random options, as the other suites draw them.
  std::uniform_int_distribution<int32_t> q_dist(1, 24), kv_dist(0, 160);
  for (int i = 0; i < 8; ++i) {
    const AttentionOptions o = RandomOptions(gen, geo, 160);
    SeqSpec& s = add(q_dist(gen), kv_dist(gen), o.window_left.value_or(-1),
                     std::bernoulli_distribution(0.7)(gen),
                     std::uniform_int_distribution<int32_t>(0, 30)(gen));
    s.soft_cap = o.logits_soft_cap.value_or(0.f);
    s.sinks = o.sinks;
    s.lse_base_e = std::bernoulli_distribution(0.3)(gen);
    if (std::bernoulli_distribution(0.3)(gen)) s.sm_scale = -s.sm_scale;
  }
  std::shuffle(specs.begin(), specs.end(), gen);
  return specs;
}

class PagedPrefillVariantTest : public ::testing::TestWithParam<VariantConfig> {};

TEST_P(PagedPrefillVariantTest, MatchesFloat64Reference) {
  const VariantConfig& c = GetParam();
  std::mt19937_64 gen(std::hash<std::string>()(c.name));
  KvGeometry geo;
  geo.num_layers = 1;
  geo.page_size = c.page_size;
  geo.num_qo_heads = 4;
  geo.num_kv_heads = 2;
  geo.head_dim = c.head_dim;
  geo.dtype = c.dtype;
  if (c.kv_lora_rank > 0) {
    geo.attention = AttentionKind::kMla;
    geo.num_kv_heads = 1;
    geo.kv_lora_rank = c.kv_lora_rank;
    geo.qk_rope_head_dim = c.head_dim - c.kv_lora_rank;
  }
  const std::vector<SeqSpec> specs = VariantCases(gen, geo);
  int64_t pages_needed = 0;
  for (const SeqSpec& s : specs) pages_needed += PagesFor(s.kv_len, c.page_size);
  geo.num_pages = static_cast<int32_t>(std::max<int64_t>(8, pages_needed / 2));
  const Problem p = MakeProblem(gen, geo, specs);
  const Coverage cov = CheckAgainstReference(p, RunKernel(p));
  EXPECT_GT(cov.blind_rows, 0);
  EXPECT_GT(cov.sink_only_rows, 0);
  EXPECT_GT(cov.seen_rows, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Variants, PagedPrefillVariantTest,
    ::testing::Values(VariantConfig{"Ps1D64Bf16", 1, 64, KvDType::kBf16},
                      VariantConfig{"Ps1D128Fp16", 1, 128, KvDType::kFp16},
                      VariantConfig{"Ps1D256Bf16", 1, 256, KvDType::kBf16},
                      VariantConfig{"Ps16D64Fp16", 16, 64, KvDType::kFp16},
                      VariantConfig{"Ps16D128Bf16", 16, 128, KvDType::kBf16},
                      VariantConfig{"Ps16D256Fp16", 16, 256, KvDType::kFp16},
                      VariantConfig{"Ps64D64Bf16", 64, 64, KvDType::kBf16},
                      VariantConfig{"Ps64D128Fp16", 64, 128, KvDType::kFp16},
                      VariantConfig{"Ps64D256Bf16", 64, 256, KvDType::kBf16},
                      VariantConfig{"Ps1D64Fp16", 1, 64, KvDType::kFp16},
                      VariantConfig{"Ps16D128Fp16", 16, 128, KvDType::kFp16},
                      VariantConfig{"Ps64D256Fp16", 64, 256, KvDType::kFp16},
                      VariantConfig{"Ps1D128Bf16", 1, 128, KvDType::kBf16},
                      VariantConfig{"Ps16D256Bf16", 16, 256, KvDType::kBf16},
                      VariantConfig{"Ps64D64Fp16", 64, 64, KvDType::kFp16},
                      VariantConfig{"Ps1D256Fp16", 1, 256, KvDType::kFp16},
                      VariantConfig{"Ps16D64Bf16", 16, 64, KvDType::kBf16},
                      VariantConfig{"Ps64D128Bf16", 64, 128, KvDType::kBf16},
                      // MLA (latent 64 + rope 16, and DeepSeek's 512 + 64).
                      VariantConfig{"MlaPs1R64P16Bf16", 1, 80, KvDType::kBf16, 64},
                      VariantConfig{"MlaPs16R64P16Fp16", 16, 80, KvDType::kFp16, 64},
                      VariantConfig{"MlaPs64R512P64Bf16", 64, 576, KvDType::kBf16, 512}),
    VariantName);

// A window costs its keys, not the sequence's: a decode row with a 128-key
// window over a 128k-key sequence reads only the page ids of its window. The
// page table's entries before the window lie in memory that cannot be read
// (PROT_NONE), so a kernel that touched them would crash the test.
TEST(PagedPrefillTest, WindowReadsOnlyItsKeys) {
  std::mt19937_64 gen(41);
  KvGeometry geo = SmallGeometry(16);
  geo.num_pages = 16;
  const int32_t kv_len = 1 << 17, window = 128;
  const int32_t entries = kv_len / geo.page_size;  // 8192 page ids
  const long page_bytes = sysconf(_SC_PAGESIZE);
  const int32_t per_os_page = static_cast<int32_t>(page_bytes / sizeof(int32_t));
  // The last os page of ids holds the window's pages; everything before is unreadable.
  const int32_t readable = per_os_page;
  ASSERT_GE(readable, (window + 1) / geo.page_size + 2);
  const size_t bytes = static_cast<size_t>(entries) * sizeof(int32_t);
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  auto* ids = static_cast<int32_t*>(map);
  std::vector<int32_t> ref_ids(entries, 0);
  for (int32_t i = entries - readable; i < entries; ++i) {
    ids[i] = ref_ids[i] = static_cast<int32_t>(i % geo.num_pages);
  }
  ASSERT_EQ(mprotect(map, bytes - readable * sizeof(int32_t), PROT_NONE), 0);

  Problem p = MakeProblem(gen, geo, {});
  p.q = RandomNonzeroHalves(gen, geo.dtype, int64_t{geo.num_qo_heads} * geo.head_dim);
  p.total_q = 1;
  PrefillSeq seq;
  seq.q_len = 1;
  seq.kv_len = kv_len;
  seq.sm_scale = 0.125f;
  seq.window_left = window;
  p.seqs = {seq};
  // The kernel reads the guarded ids; the reference a plain copy.
  Output out;
  out.o.resize(int64_t{2} * geo.num_qo_heads * geo.head_dim);
  out.lse.resize(int64_t{2} * geo.num_qo_heads);
  Poison(out.o);
  Poison(out.lse);
  PagedPrefillParams params;
  params.q = p.q.data();
  params.o = out.o.data();
  params.lse = out.lse.data();
  params.k_cache = p.k_cache.data();
  params.v_cache = p.v_cache.data();
  params.kv_indices = ids;
  params.seqs = p.seqs.data();
  params.num_seqs = 1;
  params.total_q = 1;
  params.geo = geo;
  PagedPrefillCpu(params);
  munmap(map, bytes);
  p.kv_indices = ref_ids;
  CheckAgainstReference(p, out);
}

// ------------------------------------------------------------ append / gather

TEST(AppendKvTest, AppendThenGatherRoundTripsAndTouchesNothingElse) {
  std::mt19937_64 gen(21);
  for (int32_t page_size : {1, 16}) {
    SCOPED_TRACE(testing::Message() << "page_size " << page_size);
    KvGeometry geo = SmallGeometry(page_size, KvDType::kFp16);
    geo.num_layers = 3;
    std::vector<uint16_t> k_cache = RandomNonzeroHalves(gen, geo.dtype, geo.PoolElems());
    std::vector<uint16_t> v_cache = RandomNonzeroHalves(gen, geo.dtype, geo.PoolElems());
    // Distinct slots in any order, several in the same page.
    std::vector<int64_t> all(geo.SlotsPerLayer());
    for (int64_t s = 0; s < geo.SlotsPerLayer(); ++s) all[s] = s;
    std::shuffle(all.begin(), all.end(), gen);
    const int64_t n = std::min<int64_t>(5, geo.SlotsPerLayer() / 2) + geo.SlotsPerLayer() / 3;
    std::vector<int64_t> slots(all.begin(), all.begin() + n);
    const int64_t row = geo.RowElems();
    const std::vector<uint16_t> k = RandomNonzeroHalves(gen, geo.dtype, n * row);
    const std::vector<uint16_t> v = RandomNonzeroHalves(gen, geo.dtype, n * row);

    std::vector<uint16_t> k_want = k_cache, v_want = v_cache;
    const int32_t layer = 1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t off = (layer * geo.SlotsPerLayer() + slots[i]) * row;
      std::copy(k.begin() + i * row, k.begin() + (i + 1) * row, k_want.begin() + off);
      std::copy(v.begin() + i * row, v.begin() + (i + 1) * row, v_want.begin() + off);
    }

    AppendKvParams a;
    a.k_cache = k_cache.data();
    a.v_cache = v_cache.data();
    a.k = k.data();
    a.v = v.data();
    a.slots = slots.data();
    a.n = n;
    a.layer = layer;
    a.geo = geo;
    AppendKvCpu(a);
    EXPECT_TRUE(k_cache == k_want) << "append wrote K other than the given rows";
    EXPECT_TRUE(v_cache == v_want) << "append wrote V other than the given rows";

    std::vector<uint16_t> k_back(n * row + row), v_back(n * row + row);
    Poison(k_back);
    Poison(v_back);
    GatherKvParams gp;
    gp.k_cache = k_cache.data();
    gp.v_cache = v_cache.data();
    gp.k = k_back.data();
    gp.v = v_back.data();
    gp.slots = slots.data();
    gp.n = n;
    gp.layer = layer;
    gp.geo = geo;
    GatherKvCpu(gp);
    EXPECT_TRUE(std::equal(k.begin(), k.end(), k_back.begin()));
    EXPECT_TRUE(std::equal(v.begin(), v.end(), v_back.begin()));
    for (int64_t c = n * row; c < n * row + row; ++c) {
      ASSERT_TRUE(IsPoisonHalf(k_back[c]) && IsPoisonHalf(v_back[c])) << "gather overran";
    }
  }
}

// Rows appended into pages are what a following prefill attends to.
TEST(AppendKvTest, PrefillSeesAppendedRows) {
  std::mt19937_64 gen(22);
  const KvGeometry geo = SmallGeometry(16);
  Problem p = MakeProblem(gen, geo, {Seq(12, 27, {5, 2}, 1)});
  // Overwrite the sequence's positions 16..26 (page 2, offsets 0..10).
  const int64_t n = 11;
  std::vector<int64_t> slots(n);
  for (int64_t i = 0; i < n; ++i) slots[i] = 2 * geo.page_size + i;
  const std::vector<uint16_t> k = RandomNonzeroHalves(gen, geo.dtype, n * geo.RowElems(), 2.0);
  const std::vector<uint16_t> v = RandomNonzeroHalves(gen, geo.dtype, n * geo.RowElems(), 2.0);
  const Output before = RunKernel(p);
  AppendKvParams a;
  a.k_cache = p.k_cache.data();
  a.v_cache = p.v_cache.data();
  a.k = k.data();
  a.v = v.data();
  a.slots = slots.data();
  a.n = n;
  a.layer = 1;
  a.geo = geo;
  AppendKvCpu(a);
  const Output after = RunKernel(p);
  CheckAgainstReference(p, after);
  EXPECT_FALSE(before.o == after.o) << "the appended rows changed nothing";
}

// A batch of fewer work items than two per thread splits each item's keys
// into parts whose states merge before the outputs are written: long
// decodes and short prefills, GQA (2 items: split at 2 threads, not at 1) and
// MLA (1 item: split at any thread count), with windows, soft-caps, sinks and
// rows that see nothing, match the reference at 1 thread and at the default
// count, and each other up to rounding. (The team never grows past its
// default size: LeakSanitizer reports the OpenMP runtime's thread records
// of a larger one.)
TEST(PagedPrefillTest, SplitKeysMergeToTheSameResultAsUnsplit) {
  std::mt19937_64 gen(404);
  for (const bool mla : {false, true}) {
    KvGeometry geo;
    geo.num_layers = 1;
    geo.page_size = 16;
    geo.num_pages = 600;
    geo.dtype = KvDType::kBf16;
    if (mla) {
      geo.attention = AttentionKind::kMla;
      geo.kv_lora_rank = 64;
      geo.qk_rope_head_dim = 16;
      geo.head_dim = 80;
      geo.num_qo_heads = 16;
      geo.num_kv_heads = 1;
    } else {
      geo.head_dim = 64;
      geo.num_qo_heads = 4;
      geo.num_kv_heads = 1;
    }
    std::vector<float> sinks(geo.num_qo_heads);
    for (float& x : sinks) x = std::uniform_real_distribution<float>(-2.f, 4.f)(gen);
    std::vector<SeqSpec> specs(2);
    specs[0].q_len = 1;  // a decode over 3000 keys: parts of at least 256
    specs[0].kv_len = 3000;
    specs[0].sm_scale = 0.11f;
    specs[0].soft_cap = 30.f;
    specs[0].sinks = sinks;
    specs[1].q_len = 3;  // a window of 700: the first part sees none of it
    specs[1].kv_len = 2900;
    specs[1].sm_scale = 0.09f;
    specs[1].window_left = 700;
    specs[1].causal_shift = -40;
    const Problem p = MakeProblem(gen, geo, specs);
    const int threads_before = omp_get_max_threads();
    const int64_t n_o = int64_t{p.total_q} * geo.ORowElems();
    std::vector<double> first;  // the 1-thread run's output
    for (const int threads : {1, std::max(2, threads_before)}) {
      omp_set_num_threads(threads);
      const Output out = RunKernel(p);
      CheckAgainstReference(p, out);
      if (threads == 1) {
        for (int64_t i = 0; i < n_o; ++i) first.push_back(HalfToFloat(geo.dtype, out.o[i]));
      } else {
        // Different splits sum in different orders: equal up to rounding.
        EXPECT_LT(RelNormError(geo.dtype, out.o.data(), first.data(), n_o), 5e-3)
            << "threads " << threads << (mla ? " mla" : " gqa");
      }
    }
    omp_set_num_threads(threads_before);
  }
}

}  // namespace
}  // namespace attnserve
