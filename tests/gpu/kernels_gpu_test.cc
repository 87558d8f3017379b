// The CUDA kernels alone (paged prefill + split merge, N-way merge, KV
// append/gather) on random data against a float64 reference. Outputs are
// poisoned with 0xFF bytes (NaN) before every run. Every paged prefill test
// runs once per kernel family and schedule (PagedPrefillCuda/<test>/sm80,
// .../sm90, .../sm90_overlap, .../sm90_overlap_nopp); the sm90 runs skip,
// saying so, on devices other than sm_90. The float64 reference of a batch
// is computed once and reused by the runs after the first
// (gpu_test::CachedReference).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/kv/kv_rows_cuda.h"
#include "kernels/merge/merge_cuda.h"
#include "kernels/plan/kernel_select.h"
#include "kernels/prefill_cuda.h"
#include "tests/gpu/family_run.h"

namespace attnserve {
namespace {

using gpu_test::HostBatch;

using gpu_test::DeviceBuffer;
using gpu_test::PrefillRun;
using gpu_test::RunResult;

// The kernel a test runs: the parameter's kernel for the head_dim. sm80:
// variant 1 is the 64-row tile kernel (head_dim 128), 0 the default tile.
// sm90 kernels (kSm90, kSm90Overlap, kSm90OverlapNoPp): head_dim 64 and 128
// (256 stays on sm80, as the server picks).
PrefillKernel KernelOf(PrefillKernel param, int variant, int head_dim) {
  if (IsSm90Kernel(param) && (head_dim == 64 || head_dim == 128)) return param;
  return variant == 1 ? PrefillKernel::kSm80Rows64 : PrefillKernel::kSm80;
}

RunResult RunAndCheck(const HostBatch& b, PrefillKernel kernel, bool force_split, int min_chunk,
                      int32_t max_ctas = 0, int32_t plan_ctas = -1, int64_t mean_kv_per_row = 0) {
  PrefillRun run{force_split, min_chunk, max_ctas, plan_ctas};
  run.mean_kv_per_row = mean_kv_per_row;
  return gpu_test::RunPrefill(b, kernel, run);
}

std::string Describe(const HostBatch& b, PrefillKernel kernel, bool split) {
  return std::string("kernel=") + PrefillKernelName(kernel) + (split ? " split " : " ") + gpu_test::Describe(b);
}

// Parameterized over the kernel family (kSm80, or one of the sm90 kernels);
// skips the families the device does not run.
class PagedPrefillCuda : public ::testing::TestWithParam<PrefillKernel> {
 protected:
  void SetUp() override {
    ATTNSERVE_SKIP_WITHOUT_GPU();
    int dev = 0;
    cudaDeviceProp prop;
    ASSERT_CUDA(cudaGetDevice(&dev));
    ASSERT_CUDA(cudaGetDeviceProperties(&prop, dev));
    const PrefillFamily family = Sm90() ? PrefillFamily::kSm90 : PrefillFamily::kSm80;
    if (!PrefillFamilyRunsOn(family, PrefillDevice{prop.major, prop.minor})) {
      GTEST_SKIP() << "skipped: the " << PrefillKernelName(GetParam())
                   << " kernel needs an sm_90 device; this is sm_" << prop.major << prop.minor;
    }
  }
  PrefillKernel Kernel(int variant, int head_dim) const { return KernelOf(GetParam(), variant, head_dim); }
  bool Sm90() const { return IsSm90Kernel(GetParam()); }
};

TEST_P(PagedPrefillCuda, RandomRaggedBatches) {
  std::mt19937_64 rng(20261130);
  const int kBatches = 300;
  int splits = 0;
  for (int it = 0; it < kBatches; ++it) {
    HostBatch b;
    const int dims[] = {64, 128, 128, 128, 256};
    const int heads[][2] = {{4, 4}, {8, 2}, {16, 2}, {8, 1}, {32, 4}};
    const int page_sizes[] = {1, 16, 64};
    const int* hh = heads[rng() % 5];
    b.geo.head_dim = dims[rng() % (Sm90() ? 4 : 5)];  // sm90: head_dim 64 and 128
    b.geo.num_qo_heads = hh[0];
    b.geo.num_kv_heads = hh[1];
    b.geo.page_size = page_sizes[rng() % 3];
    b.geo.dtype = rng() % 2 ? KvDType::kBf16 : KvDType::kFp16;
    b.geo.num_layers = 1 + rng() % 3;
    b.geo.num_pages = std::max(4, 1200 / b.geo.page_size);
    gpu_test::MakePools(&b, &rng);
    const int nseq = 1 + rng() % 5;
    for (int s = 0; s < nseq; ++s) {
      int q_len = 0, kv_len = 0;
      switch (rng() % 8) {
        case 0: q_len = 0; kv_len = rng() % 100; break;                        // empty sequence
        case 1: q_len = 1 + rng() % 40; kv_len = 0; break;                     // no pages
        case 2: kv_len = rng() % 60; q_len = kv_len + 1 + rng() % 50; break;   // q_len > kv_len
        case 3: q_len = 1; kv_len = 1 + rng() % 900; break;                    // decode
        default: q_len = 1 + rng() % 140; kv_len = q_len + rng() % 700; break;
      }
      const bool causal = rng() % 4 != 0;
      const bool base_e = rng() % 3 == 0;
      float scale = (0.5f + (rng() % 1000) / 1000.f) / std::sqrt(float(b.geo.head_dim));
      if (rng() % 6 == 0) scale = -scale;  // the producer flips Q's sign
      gpu_test::AddSeq(&b, q_len, kv_len, rng() % b.geo.num_layers, causal, base_e, scale, &rng);
      if (causal && rng() % 4 == 0) b.seqs.back().causal_shift = static_cast<int>(rng() % 61) - 30;
    }
    gpu_test::FinishBatch(&b, rng() % 4 == 0 ? 3.f : 1.f, &rng);
    const int variant = b.geo.head_dim == 128 ? static_cast<int>(rng() % 2) : 0;
    const bool force_split = rng() % 3 == 0;
    const int min_chunk = 64 << (rng() % 3);
    const PrefillKernel kernel = Kernel(variant, b.geo.head_dim);
    // Persistent kernels: a grid of a few CTAs (each runs many items: empty
    // tiles, split chunks and full ones in a row), or one wave; sometimes a
    // plan dealt for another grid.
    const int32_t grids[] = {0, 0, 1, 2, 3, 7};
    const int32_t max_ctas = grids[rng() % 6];
    const int32_t plan_ctas = rng() % 4 == 0 ? static_cast<int32_t>(1 + rng() % 5) : -1;
    // Half the batches as the server runs them (their mean KV length per row:
    // at page_size 16 and 64 these short batches load by cp.async on the
    // sm90 family), half with the tensor copies wherever the pages allow.
    const int64_t mean_kv = rng() % 2 ? MeanKvPerRow(b.seqs.data(), static_cast<int32_t>(b.seqs.size())) : 0;
    const RunResult r = RunAndCheck(b, kernel, force_split, min_chunk, max_ctas, plan_ctas, mean_kv);
    splits += r.split;
    ASSERT_EQ(r.error, "") << "batch " << it << " (max_ctas " << max_ctas << ", plan_ctas " << plan_ctas
                           << ", mean_kv_per_row " << mean_kv << "): " << Describe(b, kernel, r.split);
  }
  EXPECT_GT(splits, 20) << "too few batches exercised split-KV";
}

TEST_P(PagedPrefillCuda, LongKvForcesSplit) {
  std::mt19937_64 rng(7);
  HostBatch b;
  b.geo.head_dim = 128;
  b.geo.num_qo_heads = 8;
  b.geo.num_kv_heads = 1;
  b.geo.page_size = 16;
  b.geo.dtype = KvDType::kBf16;
  b.geo.num_layers = 2;
  b.geo.num_pages = 4500;  // 72,000 slots per layer
  gpu_test::MakePools(&b, &rng);
  gpu_test::AddSeq(&b, 7, 70001, 1, true, false, 1 / std::sqrt(128.f), &rng);
  gpu_test::AddSeq(&b, 3, 66000, 0, false, true, 0.1f, &rng);
  gpu_test::AddSeq(&b, 1, 100, 0, true, false, 1 / std::sqrt(128.f), &rng);
  gpu_test::FinishBatch(&b, 2.f, &rng);
  const PrefillKernel kernel = Kernel(0, 128);
  const RunResult r = RunAndCheck(b, kernel, false, 512);
  EXPECT_TRUE(r.split) << "a 70k-token KV with 10 query rows must be split";
  EXPECT_EQ(r.error, "") << Describe(b, kernel, r.split);
}

// Causal tiles whose rows all sit before the diagonal (q_len > kv_len, or no
// KV) run no KV block and must write zeros; they ran beside busy tiles in
// one launch, where another warp's late Q copy once landed over the staged
// output (server batching test, o wrong, LSE right). Many such tiles, many
// launches, both head_dim 128 variants, split and not.
TEST_P(PagedPrefillCuda, TilesWithNoKvBlockBesideBusyTiles) {
  std::mt19937_64 rng(31);
  for (int rep = 0; rep < 24; ++rep) {
    HostBatch b;
    b.geo.head_dim = 128;
    b.geo.num_qo_heads = 16;
    b.geo.num_kv_heads = 2;
    b.geo.page_size = 16;
    b.geo.dtype = KvDType::kBf16;
    b.geo.num_layers = 3;
    b.geo.num_pages = 2048;
    gpu_test::MakePools(&b, &rng);
    const int variant = rep % 2;
    const int q_big = variant == 1 ? 8 : 256;  // variant 1 holds 64 packed rows
    for (int s = 0; s < 24; ++s) {
      const float scale = 1 / std::sqrt(128.f);
      if (s % 3 == 0) {
        gpu_test::AddSeq(&b, q_big, 700 + rng() % 1000, rng() % 3, true, false, scale, &rng);
      } else {
        gpu_test::AddSeq(&b, q_big, variant == 1 ? 0 : rng() % 128, rng() % 3, true, s % 2, scale, &rng);
      }
    }
    gpu_test::FinishBatch(&b, 2.f, &rng);
    const bool force_split = rep % 3 == 2;
    const PrefillKernel kernel = Kernel(variant, 128);
    const RunResult r = RunAndCheck(b, kernel, force_split, 512);
    ASSERT_EQ(r.error, "") << "rep " << rep << ": " << Describe(b, kernel, r.split);
  }
}

TEST_P(PagedPrefillCuda, DenseLargeTiles) {
  // Several full tiles per sequence, both kernel variants, 32/4 heads.
  std::mt19937_64 rng(11);
  for (int variant = 0; variant < 2; ++variant) {
    HostBatch b;
    b.geo.head_dim = 128;
    b.geo.num_qo_heads = 32;
    b.geo.num_kv_heads = 4;
    b.geo.page_size = 1;
    b.geo.dtype = KvDType::kBf16;
    b.geo.num_layers = 1;
    b.geo.num_pages = 3000;
    gpu_test::MakePools(&b, &rng);
    gpu_test::AddSeq(&b, 300, 1000, 0, true, false, 1 / std::sqrt(128.f), &rng);
    gpu_test::AddSeq(&b, 257, 257, 0, true, false, 1 / std::sqrt(128.f), &rng);
    gpu_test::FinishBatch(&b, 1.f, &rng);
    const PrefillKernel kernel = Kernel(variant, 128);
    const RunResult r = RunAndCheck(b, kernel, false, 512);
    EXPECT_EQ(r.error, "") << Describe(b, kernel, r.split);
  }
}

// A ladder from the simplest launch up, each its own failure: one full tile
// (16 tokens x group 8 = 128 packed rows) against exactly one KV block, then
// two blocks, then enough blocks to wrap the shared-memory ring several
// times; non-causal, then causal; both head_dims and dtypes. A layout bug
// fails the first rung; a pipeline bug only the later ones.
TEST_P(PagedPrefillCuda, SingleTileLadder) {
  std::mt19937_64 rng(17);
  for (int d : {64, 128}) {
    for (KvDType dt : {KvDType::kBf16, KvDType::kFp16}) {
      for (int causal = 0; causal < 2; ++causal) {
        for (int kv : {128, 256, 1000}) {
          HostBatch b;
          b.geo.head_dim = d;
          b.geo.num_qo_heads = 16;
          b.geo.num_kv_heads = 2;
          b.geo.page_size = 1;
          b.geo.dtype = dt;
          b.geo.num_layers = 1;
          b.geo.num_pages = 1024;
          gpu_test::MakePools(&b, &rng);
          gpu_test::AddSeq(&b, 16, kv, 0, causal != 0, false, 1 / std::sqrt(float(d)), &rng);
          gpu_test::FinishBatch(&b, 1.f, &rng);
          const PrefillKernel kernel = Kernel(0, d);
          const RunResult r = RunAndCheck(b, kernel, false, 512);
          ASSERT_EQ(r.error, "") << "kv " << kv << ": " << Describe(b, kernel, r.split);
        }
      }
    }
  }
}

// causal_shift != 0 (a server holding part of a sequence's keys): negative,
// small and large positive shifts, several query tiles, GQA 4 and 8, both
// head_dims, page sizes 1 and 16, bf16 and fp16, split and not.
TEST_P(PagedPrefillCuda, CausalShift) {
  std::mt19937_64 rng(41);
  const int shifts[] = {-300, -37, -1, 1, 5, 129, 700};
  int rep = 0;
  for (int d : {64, 128}) {
    for (int ps : {1, 16}) {
      HostBatch b;
      b.geo.head_dim = d;
      b.geo.num_qo_heads = 32;
      b.geo.num_kv_heads = ps == 1 ? 4 : 8;  // GQA 8 and 4
      b.geo.page_size = ps;
      b.geo.dtype = ps == 1 ? KvDType::kBf16 : KvDType::kFp16;
      b.geo.num_layers = 2;
      b.geo.num_pages = 3000 / ps;
      gpu_test::MakePools(&b, &rng);
      for (int shift : shifts) {
        gpu_test::AddSeq(&b, 40 + rng() % 200, 300 + rng() % 900, rng() % 2, true, shift % 2 != 0,
                         1 / std::sqrt(float(d)), &rng);
        b.seqs.back().causal_shift = shift;
      }
      gpu_test::FinishBatch(&b, 1.f, &rng);
      const PrefillKernel kernel = Kernel(0, d);
      const RunResult r = RunAndCheck(b, kernel, rep++ % 2 == 1, 128);
      EXPECT_EQ(r.error, "") << Describe(b, kernel, r.split);
    }
  }
}

// The sm90 family's two loads of pages of 16 and 64 rows, the tensor copy
// engine's (mean_kv_per_row 0) and cp.async's (a short batch's mean, as the
// server runs it: Sm90TensorCopies), on the same batches: each against the
// reference, and the same bits from both (so that which load a batch takes
// never changes an answer).
TEST_P(PagedPrefillCuda, TensorCopiesAndCpAsyncBothMatch) {
  if (GetParam() != PrefillKernel::kSm90Overlap) GTEST_SKIP() << "the serving sm90 kernel's choice";
  std::mt19937_64 rng(20261207);
  for (int it = 0; it < 24; ++it) {
    HostBatch b;
    b.geo.head_dim = it % 3 == 0 ? 64 : 128;
    b.geo.num_qo_heads = 8;
    b.geo.num_kv_heads = 2;
    b.geo.page_size = it % 2 ? 64 : 16;
    b.geo.dtype = it % 4 < 2 ? KvDType::kBf16 : KvDType::kFp16;
    b.geo.num_layers = 2;
    b.geo.num_pages = std::max(4, 6000 / b.geo.page_size);
    gpu_test::MakePools(&b, &rng);
    const int nseq = 1 + rng() % 4;
    for (int s = 0; s < nseq; ++s) {
      const int q_len = 1 + rng() % 300;
      const int kv_len = q_len + rng() % 900;
      gpu_test::AddSeq(&b, q_len, kv_len, rng() % 2, rng() % 4 != 0, false,
                       1.f / std::sqrt(float(b.geo.head_dim)), &rng);
    }
    gpu_test::FinishBatch(&b, 1.f, &rng);
    const int64_t mean_kv = MeanKvPerRow(b.seqs.data(), static_cast<int32_t>(b.seqs.size()));
    ASSERT_FALSE(Sm90TensorCopies(b.geo, mean_kv)) << "a batch meant for cp.async: mean " << mean_kv;
    const PrefillKernel kernel = GetParam();
    const RunResult copies = RunAndCheck(b, kernel, it % 3 == 1, 128, 0, -1, 0);
    ASSERT_EQ(copies.error, "") << "tensor copies, batch " << it << ": " << Describe(b, kernel, copies.split);
    const RunResult async = RunAndCheck(b, kernel, it % 3 == 1, 128, 0, -1, mean_kv);
    ASSERT_EQ(async.error, "") << "cp.async, batch " << it << ": " << Describe(b, kernel, async.split);
    EXPECT_TRUE(copies.o == async.o && copies.lse == async.lse) << "batch " << it << ": " << Describe(b, kernel, async.split);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, PagedPrefillCuda,
                         // sm90_overlap before sm90: a time-limited run
                         // (bench/run_sm90_overlap_gpu.sh) checks it first,
                         // and it computes the references the others reuse.
                         ::testing::Values(PrefillKernel::kSm80, PrefillKernel::kSm90Overlap, PrefillKernel::kSm90,
                                           PrefillKernel::kSm90OverlapNoPp),
                         [](const ::testing::TestParamInfo<PrefillKernel>& info) {
                           return std::string(PrefillKernelName(info.param));
                         });

TEST(MergeStatesCuda, RandomStatesWithNegInf) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(3);
  for (int it = 0; it < 40; ++it) {
    const KvDType dt = it % 2 ? KvDType::kBf16 : KvDType::kFp16;
    const int dims[] = {64, 128, 256, 8, 20};
    const int d = dims[it % 5];
    const int h = 1 + rng() % 8;
    const int64_t n = 1 + rng() % 300;
    const int ns = it % 10 == 9 ? 16 : 1 + static_cast<int>(rng() % 5);
    const bool base_e = rng() % 2;
    std::vector<std::vector<uint16_t>> vs(ns, std::vector<uint16_t>(n * h * d));
    std::vector<std::vector<float>> ls(ns, std::vector<float>(n * h));
    std::normal_distribution<float> nd(0.f, 3.f);
    for (int s = 0; s < ns; ++s) {
      gpu_test::FillRandom(&vs[s], dt, 1.f, &rng);
      for (auto& x : ls[s]) x = rng() % 5 == 0 ? -INFINITY : nd(rng);
    }
    for (int64_t r = 0; r < n * h; r += 7) {  // some rows all -inf
      for (int s = 0; s < ns; ++s) ls[s][r] = -INFINITY;
    }
    std::string err;
    std::vector<DeviceBuffer<uint16_t>*> dv;
    std::vector<DeviceBuffer<float>*> dl;
    std::vector<const void*> vptr;
    std::vector<const float*> lptr;
    for (int s = 0; s < ns; ++s) {
      dv.push_back(new DeviceBuffer<uint16_t>(vs[s].size(), &err));
      dl.push_back(new DeviceBuffer<float>(ls[s].size(), &err));
      dv.back()->Upload(vs[s]);
      dl.back()->Upload(ls[s]);
      vptr.push_back(dv.back()->ptr);
      lptr.push_back(dl.back()->ptr);
    }
    DeviceBuffer<uint16_t> out(n * h * d, &err);
    DeviceBuffer<float> out_lse(n * h, &err);
    out.Poison();
    out_lse.Poison();
    ASSERT_EQ(err, "");
    MergeStatesParams p;
    p.v = vptr.data();  // host arrays of device pointers
    p.lse = lptr.data();
    p.num_states = ns;
    p.v_out = out.ptr;
    p.lse_out = out_lse.ptr;
    p.n = n;
    p.h = h;
    p.d = d;
    p.dtype = dt;
    p.lse_base_e = base_e;
    ASSERT_CUDA(MergeStatesCuda(p, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<double> o_ref(n * h * d, 0.0), l_ref(n * h, -INFINITY);
    const double to2 = base_e ? 1 / std::log(2.0) : 1.0;
    for (int64_t r = 0; r < n * h; ++r) {
      double m = -INFINITY;
      for (int s = 0; s < ns; ++s) m = std::max(m, double(ls[s][r]) * to2);
      if (m == -INFINITY) continue;
      double ws = 0;
      for (int s = 0; s < ns; ++s) {
        if (ls[s][r] == -INFINITY) continue;
        const double w = std::exp2(double(ls[s][r]) * to2 - m);
        ws += w;
        for (int e = 0; e < d; ++e) o_ref[r * d + e] += w * gpu_test::FromHalfBits(dt, vs[s][r * d + e]);
      }
      for (int e = 0; e < d; ++e) o_ref[r * d + e] /= ws;
      l_ref[r] = (m + std::log2(ws)) / to2;
    }
    const std::vector<uint16_t> got = out.Download();
    const std::vector<float> got_lse = out_lse.Download();
    ASSERT_EQ(err, "");
    EXPECT_EQ(gpu_test::Compare(dt, got, got_lse, o_ref, l_ref), "")
        << "iteration " << it << " d=" << d << " states=" << ns;
    for (auto* x : dv) delete x;
    for (auto* x : dl) delete x;
  }
}

TEST(AppendKvCuda, ScatterThenGatherRoundTrips) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(5);
  for (int ps : {1, 16}) {
    KvGeometry g;
    g.num_layers = 3;
    g.num_pages = 64;
    g.page_size = ps;
    g.num_qo_heads = 8;
    g.num_kv_heads = 2;
    g.head_dim = 128;
    std::string err;
    DeviceBuffer<uint16_t> kc(g.PoolElems(), &err), vc(g.PoolElems(), &err);
    ASSERT_CUDA(cudaMemset(kc.ptr, 0, g.PoolElems() * 2));
    ASSERT_CUDA(cudaMemset(vc.ptr, 0, g.PoolElems() * 2));
    // Unique random slots in layer 2, written through layer-global slots.
    std::vector<int64_t> slots(g.SlotsPerLayer());
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = i;
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(slots.size() / 2);
    const int64_t n = slots.size();
    std::vector<int64_t> global(slots);
    for (auto& s : global) s += 2 * g.SlotsPerLayer();
    std::vector<uint16_t> k(n * g.RowElems()), v(n * g.RowElems());
    gpu_test::FillRandom(&k, KvDType::kBf16, 1.f, &rng);
    gpu_test::FillRandom(&v, KvDType::kBf16, 1.f, &rng);
    DeviceBuffer<int64_t> ds(n, &err), dg(n, &err);
    ds.Upload(slots);
    dg.Upload(global);
    DeviceBuffer<uint16_t> dk(k.size(), &err), dv(v.size(), &err), gk(k.size(), &err), gv(v.size(), &err);
    dk.Upload(k);
    dv.Upload(v);
    gk.Poison();
    gv.Poison();
    ASSERT_EQ(err, "");
    AppendKvParams a;
    a.k_cache = kc.ptr;
    a.v_cache = vc.ptr;
    a.k = dk.ptr;
    a.v = dv.ptr;
    a.slots = dg.ptr;
    a.n = n;
    a.layer = 0;
    a.geo = g;
    ASSERT_CUDA(AppendKvCuda(a, nullptr));
    GatherKvParams gp;
    gp.k_cache = kc.ptr;
    gp.v_cache = vc.ptr;
    gp.k = gk.ptr;
    gp.v = gv.ptr;
    gp.slots = ds.ptr;
    gp.n = n;
    gp.layer = 2;
    gp.geo = g;
    ASSERT_CUDA(GatherKvCuda(gp, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(gk.Download(), k);
    EXPECT_EQ(gv.Download(), v);
    // Layers 0 and 1 untouched.
    std::vector<uint16_t> pool = kc.Download();
    ASSERT_EQ(err, "");
    for (int64_t i = 0; i < 2 * g.LayerElems(); ++i) ASSERT_EQ(pool[i], 0) << i;
  }
}

}  // namespace
}  // namespace attnserve
