// The attention variants (sliding window, logit soft-cap, sinks; docs/design.md,
// "Variants") in every CUDA kernel family, against the float64 reference:
// VariantsCuda/<test>/<family> runs each test once per family (the decode
// family, sm80 with either tile, the three sm90 schedules). Every batch mixes
// plain sequences with variant ones, so that one launch carries both, and
// sm90's lean kernel (no soft-cap or sink code) is checked on the same shapes
// when no sequence has either. Outputs are poisoned before each run
// (family_run.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/plan/kernel_select.h"
#include "tests/gpu/family_run.h"

namespace attnserve {
namespace {

using gpu_test::HostBatch;
using gpu_test::RunResult;

struct Family {
  const char* name;
  bool decode;           // the decode family (1..kMaxDecodeQueryRows rows)
  PrefillKernel kernel;  // otherwise this prefill kernel
};

const Family kFamilies[] = {
    {"decode", true, PrefillKernel::kSm80},
    {"sm80", false, PrefillKernel::kSm80},
    {"sm80_rows64", false, PrefillKernel::kSm80Rows64},
    {"sm90_overlap", false, PrefillKernel::kSm90Overlap},
    {"sm90", false, PrefillKernel::kSm90},
    {"sm90_overlap_nopp", false, PrefillKernel::kSm90OverlapNoPp},
};

class VariantsCuda : public ::testing::TestWithParam<Family> {
 protected:
  void SetUp() override {
    ATTNSERVE_SKIP_WITHOUT_GPU();
    int dev = 0;
    cudaDeviceProp prop;
    ASSERT_CUDA(cudaGetDevice(&dev));
    ASSERT_CUDA(cudaGetDeviceProperties(&prop, dev));
    if (!F().decode && IsSm90Kernel(F().kernel) &&
        !PrefillFamilyRunsOn(PrefillFamily::kSm90, PrefillDevice{prop.major, prop.minor})) {
      GTEST_SKIP() << "skipped: " << F().name << " needs an sm_90 device; this is sm_" << prop.major
                   << prop.minor;
    }
  }
  const Family& F() const { return GetParam(); }
  bool Decode() const { return F().decode; }
  bool Sm90() const { return !F().decode && IsSm90Kernel(F().kernel); }
  // Head dims the family runs.
  std::vector<int> Dims() const {
    if (Sm90()) return {64, 128};
    if (!Decode() && F().kernel == PrefillKernel::kSm80Rows64) return {128};
    return {64, 128, 256};
  }
  // Query rows of a sequence: the decode family's 1..8, or prefill's up to max.
  int QLen(std::mt19937_64& rng, int max) const {
    return Decode() ? 1 + static_cast<int>(rng() % kMaxDecodeQueryRows) : 1 + static_cast<int>(rng() % max);
  }
  // Runs the batch split or not (decode: forced chunks of `chunk` keys, or
  // the heuristic, or none).
  RunResult Run(const HostBatch& b, bool split, int chunk = 128) const {
    if (Decode()) return gpu_test::RunDecode(b, split ? chunk : gpu_test::kNoSplit);
    gpu_test::PrefillRun run;
    run.force_split = split;
    run.min_chunk = chunk;
    return gpu_test::RunPrefill(b, F().kernel, run);
  }
  std::string Describe(const HostBatch& b, const RunResult& r) const {
    return std::string(F().name) + (r.split ? " split " : " ") + gpu_test::Describe(b);
  }
};

HostBatch NewBatch(int d, int qo, int kv, int ps, KvDType dt, int layers, int pages, std::mt19937_64* rng) {
  HostBatch b;
  b.geo.head_dim = d;
  b.geo.num_qo_heads = qo;
  b.geo.num_kv_heads = kv;
  b.geo.page_size = ps;
  b.geo.dtype = dt;
  b.geo.num_layers = layers;
  b.geo.num_pages = pages;
  gpu_test::MakePools(&b, rng);
  return b;
}

// Random geometries and batches where each sequence draws its variants
// independently: a window (0, a few keys, about the sequence, or none), a
// soft-cap (none, 5, 30, 50), sinks (a third of them), causal or not, a
// causal shift, a negative scale, base-e LSEs; split and unsplit plans.
TEST_P(VariantsCuda, RandomVariantBatches) {
  std::mt19937_64 rng(20261201);
  const int kBatches = Decode() ? 120 : 90;
  int splits = 0, windows = 0, caps = 0, sinks = 0;
  const std::vector<int> dims = Dims();
  for (int it = 0; it < kBatches; ++it) {
    const int heads[][2] = {{4, 4}, {8, 2}, {16, 2}, {8, 1}, {32, 4}};
    const int* hh = heads[rng() % 5];
    const int page_sizes[] = {1, 16, 64};
    const int ps = page_sizes[rng() % 3];
    HostBatch b = NewBatch(dims[rng() % dims.size()], hh[0], hh[1], ps, rng() % 2 ? KvDType::kBf16 : KvDType::kFp16,
                           1 + rng() % 2, std::max(8, 2400 / ps), &rng);
    const int nseq = 1 + rng() % 5;
    for (int s = 0; s < nseq; ++s) {
      const int q_len = QLen(rng, 200);
      const int kv_len = rng() % 8 == 0 ? static_cast<int>(rng() % 3) : q_len + static_cast<int>(rng() % 1800);
      const bool causal = rng() % 4 != 0;
      float scale = (0.5f + (rng() % 1000) / 1000.f) / std::sqrt(float(b.geo.head_dim));
      if (rng() % 6 == 0) scale = -scale;
      gpu_test::AddSeq(&b, q_len, kv_len, rng() % b.geo.num_layers, causal, rng() % 3 == 0, scale, &rng);
      PrefillSeq& q = b.seqs.back();
      if (causal && rng() % 4 == 0) q.causal_shift = static_cast<int>(rng() % 61) - 30;
      switch (rng() % 5) {
        case 0: q.window_left = static_cast<int>(rng() % 4); break;
        case 1: q.window_left = static_cast<int>(rng() % 200); break;
        case 2: q.window_left = static_cast<int>(rng() % (kv_len + 50)); break;
        default: break;
      }
      const float caps_of[] = {0.f, 0.f, 5.f, 30.f, 50.f};
      q.soft_cap = caps_of[rng() % 5];
      if (rng() % 3 == 0) q.sink_index = gpu_test::AddSinkSet(&b, &rng);
      windows += q.window_left >= 0;
      caps += q.soft_cap > 0;
      sinks += q.sink_index >= 0;
    }
    gpu_test::FinishBatch(&b, rng() % 4 == 0 ? 3.f : 1.f, &rng);
    const bool split = rng() % 2 == 0;
    const RunResult r = Run(b, split, 64 << (rng() % 3));
    splits += r.split;
    ASSERT_EQ(r.error, "") << "batch " << it << ": " << Describe(b, r);
  }
  EXPECT_GT(splits, kBatches / 5) << "too few batches exercised split KV";
  EXPECT_GT(windows, kBatches / 2);
  EXPECT_GT(caps, kBatches / 2);
  EXPECT_GT(sinks, kBatches / 3);
}

// Windows at their edges, over KV long enough that the plan clips the tiles'
// key ranges (kernels/variant.h, RowsKeys) and cuts only the keys rows see:
// 0 (the diagonal alone), 1, page-1, page, 127, 128, 129 and wider than the
// sequence; causal and not (a left bound only), causal shifts, page sizes 1
// (cp.async) and 16 (the tensor copy engine's runs), split and unsplit.
TEST_P(VariantsCuda, WindowEdgesOverLongKv) {
  std::mt19937_64 rng(77);
  const int d = Dims().back() == 256 ? 128 : Dims().back();
  for (int ps : {1, 16}) {
    for (int split = 0; split < 2; ++split) {
      HostBatch b = NewBatch(d, 16, 2, ps, KvDType::kBf16, 2, 9000 / ps + 2, &rng);
      const int windows[] = {0, 1, ps - 1, ps, 127, 128, 129, 5000, 20000};
      int i = 0;
      for (int w : windows) {
        if (w < 0) continue;
        const int q_len = QLen(rng, 300);
        const int kv_len = 6000 + static_cast<int>(rng() % 2500);
        gpu_test::AddSeq(&b, q_len, kv_len, i % 2, i % 3 != 2, i % 2 == 1, 1 / std::sqrt(float(d)), &rng);
        b.seqs.back().window_left = w;
        if (i % 4 == 1) b.seqs.back().causal_shift = -static_cast<int>(rng() % 40);
        if (i % 4 == 3) b.seqs.back().causal_shift = static_cast<int>(rng() % 40);
        ++i;
      }
      gpu_test::FinishBatch(&b, 1.f, &rng);
      const RunResult r = Run(b, split != 0, 256);
      ASSERT_EQ(r.error, "") << Describe(b, r);
      if (split != 0) EXPECT_TRUE(r.split) << "forced chunks over 6000 keys did not split";
    }
  }
}

// Sinks where rows see no key (a negative causal shift, no KV at all, a
// window that ends before the KV begins): o = 0 and LSE = the sink; beside
// rows that see keys, with and without soft-caps, split (only chunk 0 adds
// the sink) and not.
TEST_P(VariantsCuda, SinksOnEmptyAndFullRows) {
  std::mt19937_64 rng(91);
  for (int d : Dims()) {
    for (int split = 0; split < 2; ++split) {
      HostBatch b = NewBatch(d, 8, 2, 16, KvDType::kFp16, 1, 400, &rng);
      const int32_t set0 = gpu_test::AddSinkSet(&b, &rng);
      const int32_t set1 = gpu_test::AddSinkSet(&b, &rng);
      gpu_test::AddSeq(&b, QLen(rng, 40), 0, 0, true, false, 0.1f, &rng);  // no KV
      b.seqs.back().sink_index = set0;
      gpu_test::AddSeq(&b, QLen(rng, 40), 900, 0, true, true, 0.1f, &rng);
      b.seqs.back().causal_shift = -950;  // every row before the first key
      b.seqs.back().sink_index = set1;
      gpu_test::AddSeq(&b, QLen(rng, 100), 3000, 0, true, false, 0.12f, &rng);
      b.seqs.back().sink_index = set0;
      b.seqs.back().soft_cap = 30.f;
      gpu_test::AddSeq(&b, QLen(rng, 100), 2500, 0, false, false, -0.09f, &rng);
      b.seqs.back().sink_index = set1;
      b.seqs.back().window_left = 64;
      gpu_test::AddSeq(&b, QLen(rng, 100), 1200, 0, true, true, 0.1f, &rng);  // plain beside them
      gpu_test::FinishBatch(&b, 1.f, &rng);
      const RunResult r = Run(b, split != 0, 128);
      ASSERT_EQ(r.error, "") << Describe(b, r);
    }
  }
}

// Soft-caps where they bite: Q scaled so that raw logits reach tens (the cap
// of 5 flattens them, 30 and 50 bend them), both dtypes, with and without
// windows; then the same shapes with neither soft-cap nor sink (the lean
// sm90 kernel) for comparison.
TEST_P(VariantsCuda, SoftCapOnLargeLogitsAndTheLeanKernel) {
  std::mt19937_64 rng(123);
  for (int d : Dims()) {
    for (KvDType dt : {KvDType::kBf16, KvDType::kFp16}) {
      for (int variants = 0; variants < 2; ++variants) {
        HostBatch b = NewBatch(d, 32, 4, 16, dt, 1, 300, &rng);
        const float caps[] = {5.f, 30.f, 50.f};
        for (int i = 0; i < 3; ++i) {
          gpu_test::AddSeq(&b, QLen(rng, 260), 700 + static_cast<int>(rng() % 1500), 0, true, i == 1,
                           1 / std::sqrt(float(d)), &rng);
          if (variants != 0) b.seqs.back().soft_cap = caps[i];
          if (variants != 0 && i == 2) b.seqs.back().window_left = 300;
        }
        gpu_test::FinishBatch(&b, 4.f, &rng);
        const RunResult r = Run(b, false);
        ASSERT_EQ(r.error, "") << Describe(b, r);
      }
    }
  }
}

// Soft-capped rows whose every logit sits near -cap: K's values all
// positive, Q's all negative and large, so that each scaled logit is below
// -3 c and its soft-capped value within 1% of -c. The sm90 family runs
// bf16 rows with c <= 38 at a fixed maximum of c log2(e) - 8 (no row
// maxima), which puts these rows' exponents near their lowest, -2 c log2(e)
// + 8; the caps around that bound (30, 38, 39, 50) and both dtypes, causal
// and not, split and not.
TEST_P(VariantsCuda, SoftCapRowsAtTheFloor) {
  std::mt19937_64 rng(2026120319);
  for (int d : Dims()) {
    for (KvDType dt : {KvDType::kBf16, KvDType::kFp16}) {
      for (int split = 0; split < 2; ++split) {
        HostBatch b = NewBatch(d, 16, 4, 16, dt, 1, 200, &rng);
        const float caps[] = {30.f, 38.f, 39.f, 50.f, 5.f};
        for (int i = 0; i < 5; ++i) {
          gpu_test::AddSeq(&b, QLen(rng, 150), 300 + static_cast<int>(rng() % 1200), 0, i % 2 == 0, i == 3,
                           1 / std::sqrt(float(d)), &rng);
          b.seqs.back().soft_cap = caps[i];
        }
        gpu_test::FinishBatch(&b, 40.f, &rng);
        for (uint16_t& x : b.k_pool) x &= 0x7fff;  // every K value >= 0
        for (uint16_t& x : b.q) x |= 0x8000;       // every Q value <= 0
        const RunResult r = Run(b, split != 0, 128);
        ASSERT_EQ(r.error, "") << Describe(b, r);
      }
    }
  }
}

// Soft-caps and scales at the ends of their ranges over keys whose dot
// product is exactly 0 (row 3 of every page zero in K): scale / c overflows
// float32 for the tiny cap or the huge scale, which made those logits
// 0 x inf = NaN; LogitTransform::Of keeps the multiplier finite (as
// tests/kernels' ExtremeSoftCapsAndScalesOverZeroDotProducts on the CPU).
TEST_P(VariantsCuda, ExtremeSoftCapsAndScalesOverZeroDotProducts) {
  std::mt19937_64 rng(20261205);
  for (int d : Dims()) {
    for (int split = 0; split < 2; ++split) {
      HostBatch b = NewBatch(d, 16, 4, 16, KvDType::kBf16, 1, 100, &rng);
      for (const reference::ScaleAndCap& c : reference::kExtremeScalesAndCaps) {
        gpu_test::AddSeq(&b, QLen(rng, 100), 200 + static_cast<int>(rng() % 400), 0, true, false, c.sm_scale,
                         &rng);
        b.seqs.back().soft_cap = c.soft_cap;
      }
      gpu_test::FinishBatch(&b, 1.f, &rng);
      const size_t row = size_t{4} * d;
      for (int page = 0; page < b.geo.num_pages; ++page) {
        std::fill_n(b.k_pool.begin() + (size_t{16} * page + 3) * row, row, uint16_t{0});
      }
      const RunResult r = Run(b, split != 0);
      ASSERT_EQ(r.error, "") << Describe(b, r);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, VariantsCuda, ::testing::ValuesIn(kFamilies),
                         [](const ::testing::TestParamInfo<Family>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace attnserve
