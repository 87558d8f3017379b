// FP8 KV caches on the GPU (docs/design.md section 3, "FP8 KV cache"),
// against the float64 reference over the dequantized stored values:
//  - the decode family reading FP8 pools (both formats, both query dtypes,
//    head_dim 64/128/256, page sizes 1..128, GQA, per-layer and per-head
//    scales, variants, split / unsplit / cluster plans), and the same batch
//    without its scales failing the comparison;
//  - the prefill families' FP8 kernels (sm80 and sm80_rows64 at head_dim
//    64/128/256, kSm90Overlap at 64/128) over the same range of batches,
//    and kSm90 / kSm90OverlapNoPp refusing FP8 pools; the sm90 family's
//    conversion of bf16 Q rows to fp16 alone, bit for bit;
//  - CudaBackend on an FP8 cache: the device quantizer bit for bit against
//    kernels/fp8.h's on the host, ReadKv of the stored bytes and dequantized,
//    FP8 rows stored as they are, SetKvScales, and batches of decode and
//    prefill rows with fused 16-bit and FP8 appends.
// Outputs are poisoned before each run.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/reference.h"
#include "gtest/gtest.h"
#include "kernels/fp8.h"
#include "kernels/plan/kernel_select.h"
#include "kernels/sm90/prefill_sm90.h"
#include "server/backend/backend.h"
#include "server/backend/cuda/cuda_backend.h"
#include "tests/gpu/family_run.h"
#include "tests/gpu/q_rows_probe.h"

namespace attnserve {
namespace {

using gpu_test::HostBatch;

// A sequence of q_len rows over kv_len keys on a random layer, causal or not,
// with a random LSE base, causal shift, window, soft-cap, sink (when the batch
// has a set) and, negative_scales, sometimes a negative scale.
void AddVariedSeq(HostBatch* b, int q_len, int kv_len, bool negative_scales, std::mt19937_64* rng) {
  gpu_test::AddSeq(b, q_len, kv_len, static_cast<int>((*rng)() % 2), (*rng)() % 4 != 0, (*rng)() % 3 == 0,
                   1 / std::sqrt(float(b->geo.head_dim)), rng);
  PrefillSeq& q = b->seqs.back();
  if ((*rng)() % 4 == 0) q.causal_shift = static_cast<int>((*rng)() % 11);
  if ((*rng)() % 4 == 0) q.window_left = static_cast<int>((*rng)() % 600);
  if ((*rng)() % 4 == 0) q.soft_cap = 20.f;
  if (negative_scales && (*rng)() % 6 == 0) q.sm_scale = -q.sm_scale;
  if (!b->sinks.empty() && (*rng)() % 2 == 0) q.sink_index = 0;
}

// A random decode-family batch on an FP8 pool (round picks the geometry).
HostBatch MakeFp8Batch(int round, std::mt19937_64* rng) {
  HostBatch b;
  const int dims[] = {128, 64, 256};
  const int page_sizes[] = {16, 1, 128, 64, 7};
  b.geo.head_dim = dims[round % 3];
  b.geo.page_size = page_sizes[round % 5];
  b.geo.num_kv_heads = 1 + round % 3;
  const int groups[] = {4, 1, 8, 2};
  b.geo.num_qo_heads = b.geo.num_kv_heads * groups[round % 4];
  b.geo.dtype = (round / 2) % 2 == 0 ? KvDType::kBf16 : KvDType::kFp16;
  b.geo.num_layers = 2;
  b.geo.num_pages = 9000 / b.geo.page_size + 4;
  gpu_test::MakePools(&b, rng);
  gpu_test::QuantizePools(&b, round % 2 == 0 ? Fp8Format::kE4m3 : Fp8Format::kE5m2,
                          /*per_head=*/round % 3 != 1, rng);
  if ((*rng)() % 2 == 0) gpu_test::AddSinkSet(&b, rng);
  const int nseq = 1 + static_cast<int>((*rng)() % 6);
  for (int s = 0; s < nseq; ++s) {
    const int q_len = 1 + static_cast<int>((*rng)() % kMaxDecodeQueryRows);
    int kv_len = (*rng)() % 3 == 0 ? 3000 + static_cast<int>((*rng)() % 5000)
                                   : 1 + static_cast<int>((*rng)() % 1500);
    kv_len = std::max(kv_len, q_len);
    AddVariedSeq(&b, q_len, kv_len, /*negative_scales=*/false, rng);
  }
  gpu_test::FinishBatch(&b, 1.f, rng);
  return b;
}

TEST(Fp8Cuda, DecodeFamilyMatchesReferenceOverDequantizedValues) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(8008);
  int split = 0, cluster = 0;
  const bool clusters = DecodeMaxCluster(128, KvDType::kBf16, 16, Fp8Format::kE4m3) >= 2;
  for (int round = 0; round < 30; ++round) {
    const HostBatch b = MakeFp8Batch(round, &rng);
    const int chunks[] = {0, gpu_test::kNoSplit, 256};
    const int force_cluster = clusters && round % 5 == 4 ? 2 + round % 3 : 0;
    const gpu_test::RunResult r = gpu_test::RunDecode(b, chunks[round % 3], force_cluster);
    EXPECT_EQ(r.error, "") << "round " << round << ": " << gpu_test::Describe(b);
    split += r.split;
    cluster += r.cluster > 1;
    // The same batch read without its scales must fail the comparison (the
    // scales are drawn away from 1): the test can fail.
    if (round % 6 == 0) {
      const gpu_test::RunResult no_scales = gpu_test::RunDecode(b, chunks[round % 3], force_cluster, true);
      EXPECT_NE(no_scales.error, "") << "round " << round << " matched without its scales";
    }
  }
  EXPECT_GT(split, 3);
  if (clusters) EXPECT_GT(cluster, 1);
}

// The decode kernel stores bf16 queries over an FP8 pool as fp16 times a
// power of two chosen per row (QHalfExponent in kernels/fp8_device.cuh).
// Each tile mixes heads of very different magnitudes: head 3 of every group
// is 2^40 in dimension 0 and 0 elsewhere, and dimension 0 of every stored
// key is 0 (so its logits are 0, exactly); the other heads are N(0, 1)
// times 2^-12 .. 2^2. One exponent for the whole tile would flush the other
// heads to zero (the test can fail); one per row keeps them exact.
TEST(Fp8Cuda, Bf16QueriesOfEveryMagnitudeMatchReference) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(4040);
  for (int round = 0; round < 6; ++round) {
    HostBatch b;
    const int dims[] = {128, 64, 256};
    b.geo.head_dim = dims[round % 3];
    b.geo.page_size = round % 2 == 0 ? 16 : 1;
    b.geo.num_kv_heads = 2;
    b.geo.num_qo_heads = 16;
    b.geo.dtype = KvDType::kBf16;
    b.geo.num_layers = 2;
    b.geo.num_pages = 9000 / b.geo.page_size + 4;
    gpu_test::MakePools(&b, &rng);
    gpu_test::QuantizePools(&b, round % 2 == 0 ? Fp8Format::kE4m3 : Fp8Format::kE5m2, /*per_head=*/true, &rng);
    const int D = b.geo.head_dim;
    for (size_t r = 0; r < b.k8.size(); r += D) b.k8[r] = 0;
    for (int s = 0; s < 3; ++s) {
      gpu_test::AddSeq(&b, 1 + static_cast<int>(rng() % 4), 100 + static_cast<int>(rng() % 3000), s % 2, true,
                       false, 1 / std::sqrt(float(D)), &rng);
    }
    gpu_test::FinishBatch(&b, 1.f, &rng);
    const int H = b.geo.num_qo_heads;
    for (int t = 0; t < b.total_q; ++t) {
      for (int h = 0; h < H; ++h) {
        uint16_t* row = &b.q[(size_t(t) * H + h) * D];
        const int g = h % 8;
        for (int j = 0; j < D; ++j) {
          const double x = gpu_test::FromHalfBits(b.geo.dtype, row[j]);
          const float y = g == 3 ? (j == 0 ? std::ldexp(1.f, 40) : 0.f) : static_cast<float>(std::ldexp(x, 2 * g - 12));
          row[j] = gpu_test::ToHalfBits(b.geo.dtype, y);
        }
      }
    }
    const int chunks[] = {0, gpu_test::kNoSplit, 256};
    const gpu_test::RunResult r = gpu_test::RunDecode(b, chunks[round % 3], 0);
    EXPECT_EQ(r.error, "") << "round " << round << ": " << gpu_test::Describe(b);
    // The prefill families convert their Q tiles the same way (QRowsToHalf
    // in kernels/sm90/fp8_tiles.cuh; the sm80 kernel's Q tile conversion).
    if (D != 256 && Sm90PrefillSupported()) {
      const gpu_test::RunResult p = gpu_test::RunPrefill(b, PrefillKernel::kSm90Overlap);
      EXPECT_EQ(p.error, "") << "sm90 round " << round << ": " << gpu_test::Describe(b);
    }
    for (const PrefillKernel k : {PrefillKernel::kSm80, PrefillKernel::kSm80Rows64}) {
      const gpu_test::RunResult p = gpu_test::RunPrefill(b, k);
      EXPECT_EQ(p.error, "") << PrefillKernelName(k) << " round " << round << ": " << gpu_test::Describe(b);
    }
  }
}

// Rows of tiny queries (|q| ~ 2^-100: their fp16 Q carries 2^100) at tiny
// or zero scales: the prefill families' multiplier sm_scale x k_scale x
// log2(e) x 2^-100 underflowed to 0, and a masked key's -inf x 0 made the
// causal rows NaN; it is now at least float32's smallest normal
// (LogitTransform::TimesPow2, kernels/variant.h). Every logit is 0 to
// float precision either way: each row attends uniformly.
TEST(Fp8Cuda, TinyScalesOverTinyQueriesStayFinite) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(4141);
  for (int round = 0; round < 4; ++round) {
    HostBatch b;
    b.geo.head_dim = round < 2 ? 128 : 64;
    b.geo.page_size = round % 2 == 0 ? 16 : 1;
    b.geo.num_kv_heads = 2;
    b.geo.num_qo_heads = 8;
    b.geo.dtype = KvDType::kBf16;
    b.geo.num_layers = 2;
    b.geo.num_pages = 6000 / b.geo.page_size + 4;
    gpu_test::MakePools(&b, &rng);
    gpu_test::QuantizePools(&b, round % 2 == 0 ? Fp8Format::kE4m3 : Fp8Format::kE5m2, /*per_head=*/true, &rng);
    const float scales[] = {1e-31f, 0.f, -1e-33f, 1e-36f};
    for (int s = 0; s < 4; ++s) {
      gpu_test::AddSeq(&b, 20 + static_cast<int>(rng() % 140), 200 + static_cast<int>(rng() % 1200), s % 2,
                       /*causal=*/true, false, scales[s], &rng);
    }
    gpu_test::FinishBatch(&b, std::ldexp(1.f, -100), &rng);
    if (Sm90PrefillSupported()) {
      const gpu_test::RunResult p = gpu_test::RunPrefill(b, PrefillKernel::kSm90Overlap);
      EXPECT_EQ(p.error, "") << "sm90 round " << round << ": " << gpu_test::Describe(b);
    }
    for (const PrefillKernel k : {PrefillKernel::kSm80, PrefillKernel::kSm80Rows64}) {
      const gpu_test::RunResult p = gpu_test::RunPrefill(b, k);
      EXPECT_EQ(p.error, "") << PrefillKernelName(k) << " round " << round << ": " << gpu_test::Describe(b);
    }
  }
}

// The sm90 consumers' conversion of bf16 Q rows to fp16 times 2^e
// (QRowsToHalf, kernels/sm90/fp8_tiles.cuh, which finds each row's largest
// magnitude on the bits) bit for bit against its definition: e is
// QHalfExponent of the row's largest finite |q| (kernels/fp8_device.cuh),
// each element q * 2^e (times -1 for a negative scale) rounded once to
// fp16. Rows span magnitudes 2^-140 (bf16 subnormals) to 3.2e38 (above
// 3.0e38, e = 0), zero rows, and, in the second tile of each case, rows
// holding an infinity or a NaN (the warps that hold them take the float
// path; their other rows must come out the same).
int HostQHalfExponent(float amax) {
  if (!(amax > 0.f) || !(amax <= 3.0e38f)) return 0;
  return std::max(-100, std::min(100, 14 - std::ilogb(amax)));
}

TEST(Fp8Cuda, Sm90QRowConversionMatchesDefinitionBitForBit) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  if (!Sm90PrefillSupported()) GTEST_SKIP() << "needs an sm_90 device";
  constexpr int kRows = 128;
  std::mt19937_64 rng(5150);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int D : {64, 128}) {
    for (int special = 0; special < 2; ++special) {
      for (bool negative : {false, true}) {
        std::vector<uint16_t> q(size_t(kRows) * D);
        for (int r = 0; r < kRows; ++r) {
          // Row r's scale 2^k: -140 .. 127 over rows 0 .. 99; rows 100 .. 103
          // zero; the rest mix one large element with small ones.
          const int k = -140 + (r * 267) / 99;
          for (int j = 0; j < D; ++j) {
            float x = std::max(-1.9f, std::min(1.9f, normal(rng)));
            if (r < 100) {
              x = std::ldexp(x, std::min(k, 127));
            } else if (r < 104) {
              x = (j % 2 == 0) ? 0.f : -0.f;
            } else {
              x = j == r % D ? std::ldexp(1.f, r - 60) : std::ldexp(x, -20);
            }
            q[size_t(r) * D + j] = gpu_test::ToHalfBits(KvDType::kBf16, x);
          }
        }
        if (special == 1) {
          q[size_t(5) * D + 3] = 0x7f80;   // +inf
          q[size_t(77) * D + 0] = 0xff80;  // -inf
          q[size_t(90) * D + 9] = 0x7fc1;  // NaN
        }
        uint16_t* d_in = nullptr;
        uint16_t* d_out = nullptr;
        int8_t* d_exps = nullptr;
        ASSERT_CUDA(cudaMalloc(&d_in, q.size() * 2));
        ASSERT_CUDA(cudaMalloc(&d_out, q.size() * 2));
        ASSERT_CUDA(cudaMalloc(&d_exps, kRows));
        ASSERT_CUDA(cudaMemcpy(d_in, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
        ASSERT_CUDA(cudaMemset(d_out, 0xff, q.size() * 2));
        ASSERT_CUDA(cudaMemset(d_exps, 0x7f, kRows));
        const cudaError_t run = gpu_test::RunQRowsProbe(D, d_in, d_out, d_exps, negative);
        std::vector<uint16_t> out(q.size());
        std::vector<int8_t> exps(kRows);
        ASSERT_CUDA(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
        ASSERT_CUDA(cudaMemcpy(exps.data(), d_exps, kRows, cudaMemcpyDeviceToHost));
        ASSERT_CUDA(cudaFree(d_in));
        ASSERT_CUDA(cudaFree(d_out));
        ASSERT_CUDA(cudaFree(d_exps));
        ASSERT_EQ(run, cudaSuccess) << cudaGetErrorString(run);
        int mismatches = 0;
        for (int r = 0; r < kRows; ++r) {
          float amax = 0.f;
          for (int j = 0; j < D; ++j) {
            const float a = std::fabs(static_cast<float>(gpu_test::FromHalfBits(KvDType::kBf16, q[size_t(r) * D + j])));
            if (std::isfinite(a)) amax = std::max(amax, a);
          }
          const int e = HostQHalfExponent(amax);
          EXPECT_EQ(exps[r], e) << "D " << D << " special " << special << " negative " << negative << " row " << r
                                << " amax " << amax;
          for (int j = 0; j < D && mismatches < 10; ++j) {
            const double x = gpu_test::FromHalfBits(KvDType::kBf16, q[size_t(r) * D + j]);
            const float y = static_cast<float>(std::ldexp(x, e) * (negative ? -1.0 : 1.0));
            const uint16_t want = gpu_test::ToHalfBits(KvDType::kFp16, y);
            const uint16_t got = out[size_t(r) * D + j];
            const bool both_nan = std::isnan(y) && std::isnan(gpu_test::FromHalfBits(KvDType::kFp16, got));
            if (got != want && !both_nan) {
              ++mismatches;
              ADD_FAILURE() << "D " << D << " special " << special << " negative " << negative << " row " << r
                            << " col " << j << ": q bits " << q[size_t(r) * D + j] << ", e " << e << ", fp16 bits "
                            << got << " want " << want;
            }
          }
        }
      }
    }
  }
}

// A random prefill batch on an FP8 pool (round picks the geometry; head_dim
// 64 and 128, and 256 with_256): sequences of 1 .. 300 rows over up to
// 6,000 keys, with every variant, negative scales and base-e LSEs.
// fp8q: head_dim 128 whatever the round (the FP8-query kernel's geometry;
// E4M3 and E5M2 pools alike). Queries from N(0, q_scale^2).
HostBatch MakeFp8PrefillBatch(int round, std::mt19937_64* rng, bool with_256 = false, bool fp8q = false,
                              float q_scale = 1.f) {
  HostBatch b;
  const int page_sizes[] = {16, 1, 128, 7, 64, 8};
  // Each page size with every head_dim (rounds 0-5 head_dim 128, 6-11 64,
  // then 256 or 128 again, ...).
  const int dims[] = {128, 64, with_256 ? 256 : 128};
  b.geo.head_dim = fp8q ? 128 : dims[(round / 6) % 3];
  b.geo.page_size = page_sizes[round % 6];
  b.geo.num_kv_heads = 1 + round % 3;
  const int groups[] = {4, 1, 8, 2, 5};
  b.geo.num_qo_heads = b.geo.num_kv_heads * groups[round % 5];
  b.geo.dtype = (round / 2) % 2 == 0 ? KvDType::kBf16 : KvDType::kFp16;
  b.geo.num_layers = 2;
  b.geo.num_pages = 14000 / b.geo.page_size + 4;
  gpu_test::MakePools(&b, rng);
  gpu_test::QuantizePools(&b, (round / 4) % 2 == 0 ? Fp8Format::kE4m3 : Fp8Format::kE5m2,
                          /*per_head=*/round % 3 != 1, rng);
  if ((*rng)() % 2 == 0) gpu_test::AddSinkSet(&b, rng);
  const int nseq = 1 + static_cast<int>((*rng)() % 4);
  for (int s = 0; s < nseq; ++s) {
    const int q_len = 1 + static_cast<int>((*rng)() % 300);
    int kv_len = (*rng)() % 3 == 0 ? 2000 + static_cast<int>((*rng)() % 4000)
                                   : 1 + static_cast<int>((*rng)() % 1500);
    kv_len = std::max(kv_len, q_len);
    AddVariedSeq(&b, q_len, kv_len, /*negative_scales=*/true, rng);
  }
  gpu_test::FinishBatch(&b, q_scale, rng);
  return b;
}

// The largest |LSE - reference| over rows the reference gives a finite LSE;
// with bounds, the largest such error over its row's bound.
double LseMaxError(const std::vector<float>& lse, const std::vector<double>& ref,
                   const std::vector<double>* bounds = nullptr) {
  double worst = 0;
  for (size_t i = 0; i < ref.size() && i < lse.size(); ++i) {
    if (std::isfinite(ref[i])) worst = std::max(worst, std::fabs(lse[i] - ref[i]) / (bounds ? (*bounds)[i] : 1.0));
  }
  return worst;
}

// The sm90 family's FP8 kernels (kSm90Overlap, Traits::kFp8) against the
// float64 reference over the dequantized values: both formats and query
// dtypes, head_dim 64 / 128, page sizes 1 .. 128 (tensor copies from 8 on,
// cp.async below and for partial blocks), GQA, per-layer and per-head
// scales, every variant; the heuristic's plan, plans split to min_chunk
// (the merge family), and a grid of 3 CTAs (many tiles a CTA: the Q tile a
// tile ahead and its conversion). A batch read without its scales fails.
TEST(Fp8Cuda, Sm90PrefillMatchesReferenceOverDequantizedValues) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  if (!Sm90PrefillSupported()) GTEST_SKIP() << "needs an sm_90 device";
  std::mt19937_64 rng(9090);
  int split = 0;
  for (int round = 0; round < 24; ++round) {
    const HostBatch b = MakeFp8PrefillBatch(round, &rng);
    gpu_test::PrefillRun run;
    if (round % 3 == 1) {
      run.force_split = true;
      run.min_chunk = 256;
    }
    if (round % 3 == 2) run.max_ctas = 3;
    const gpu_test::RunResult r = gpu_test::RunPrefill(b, PrefillKernel::kSm90Overlap, run);
    EXPECT_EQ(r.error, "") << "round " << round << ": " << gpu_test::Describe(b);
    split += r.split;
    // Each round's errors, for the record (the results files quote them).
    if (r.error.empty()) {
      std::printf("FP8_PREFILL_ERROR round=%d kv=%s head_dim=%d q_dtype=%s rel_error=%.3e lse_error=%.3e\n", round,
                  b.geo.kv_fp8 == Fp8Format::kE4m3 ? "e4m3" : "e5m2", b.geo.head_dim,
                  b.geo.dtype == KvDType::kBf16 ? "bf16" : "fp16",
                  gpu_test::OutputRelError(b.geo.dtype, r.o, gpu_test::CachedReference(b)->o),
                  LseMaxError(r.lse, gpu_test::CachedReference(b)->lse));
    }
    if (round % 6 == 0) {
      run.drop_scales = true;
      const gpu_test::RunResult no_scales = gpu_test::RunPrefill(b, PrefillKernel::kSm90Overlap, run);
      EXPECT_NE(no_scales.error, "") << "round " << round << " matched without its scales";
    }
  }
  EXPECT_GT(split, 3);
}

// The FP8-query kernel (kSm90Fp8Q: S = Q K^T in FP8) against the float64
// reference over the dequantized pools and the queries rounded as the kernel
// rounds them (the reference's own rounding, reference::Seq::fp8_queries):
// head_dim 128, E4M3 and E5M2 pools (K's bytes the B operand as stored
// either way), bf16 and fp16 queries, page sizes 1 .. 128, GQA, per-layer
// and per-head scales, negative scales, every variant, split plans and a
// grid of 3 CTAs. The output bound is every kernel's (relative norm error
// below 1e-2); each LSE within the reference's bound of its row
// (reference::kFp8QueryLseBound or more with the row's logits), not 1e-3:
// the FP8 tensor cores sum a step's 32 products with fewer bits than fp32
// (docs/design.md section 3, "FP8 KV cache"). Its own error against the
// reference over the queries as sent is printed (FP8_Q_ERROR lines), not
// bounded: it is what a user opts into. It refuses head_dim 64 and 16-bit
// pools.
TEST(Fp8Cuda, Sm90Fp8QueriesMatchReferenceOverRoundedQueries) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  if (!Sm90PrefillSupported()) GTEST_SKIP() << "needs an sm_90 device";
  std::mt19937_64 rng(9191);
  int split = 0;
  int wide_bounds = 0;  // rounds whose LSE bounds grew past the floor with the logits
  double worst = 0;
  for (int round = 0; round < 24; ++round) {
    // Every fourth round's queries from N(0, 16): logits large enough that
    // the rows' bounds grow with them (reference::kFp8QueryLseSlope).
    const float q_scale = round % 4 == 3 ? 4.f : 1.f;
    const HostBatch b = MakeFp8PrefillBatch(round, &rng, /*with_256=*/false, /*fp8q=*/true, q_scale);
    gpu_test::PrefillRun run;
    run.fp8_query_min_rows = 1;  // every sequence's rows rounded
    if (round % 3 == 1) {
      run.force_split = true;
      run.min_chunk = 256;
    }
    if (round % 3 == 2) run.max_ctas = 3;
    const gpu_test::RunResult r = gpu_test::RunPrefill(b, PrefillKernel::kSm90Fp8Q, run);
    EXPECT_EQ(r.error, "") << "round " << round << ": " << gpu_test::Describe(b);
    split += r.split;
    const auto rounded = gpu_test::CachedReference(b, 1);
    wide_bounds += *std::max_element(rounded->lse_bound.begin(), rounded->lse_bound.end()) >
                   reference::kFp8QueryLseBound;
    if (r.error.empty()) {
      const double rel = gpu_test::OutputRelError(b.geo.dtype, r.o, gpu_test::CachedReference(b)->o);
      worst = std::max(worst, rel);
      std::printf(
          "FP8_Q_ERROR round=%d kv=%s q_dtype=%s q_scale=%g rel_error_vs_unrounded_q=%.3e lse_vs_unrounded_q=%.3e "
          "rel_error_vs_rounded_q=%.3e lse_vs_rounded_q=%.3e lse_error_over_bound=%.3f\n",
          round, Fp8FormatName(b.geo.kv_fp8), b.geo.dtype == KvDType::kBf16 ? "bf16" : "fp16", q_scale, rel,
          LseMaxError(r.lse, gpu_test::CachedReference(b)->lse), gpu_test::OutputRelError(b.geo.dtype, r.o, rounded->o),
          LseMaxError(r.lse, rounded->lse), LseMaxError(r.lse, rounded->lse, &rounded->lse_bound));
    }
  }
  std::printf("FP8_Q_ERROR worst=%.3e\n", worst);
  EXPECT_GT(split, 3);
  EXPECT_GT(wide_bounds, 0) << "no round's logits were large enough to widen a row's bound";
  // Geometries it does not run: head_dim 64, and 16-bit pools.
  for (int round : {6, 0}) {
    HostBatch b = MakeFp8PrefillBatch(round, &rng);
    if (round == 0) b.geo.kv_fp8 = Fp8Format::kNone;  // its 16-bit pools
    ASSERT_TRUE(!b.geo.KvIsFp8() || b.geo.head_dim == 64);
    std::string err;
    gpu_test::DeviceBatch d(b, &err);
    ASSERT_EQ(err, "");
    EXPECT_EQ(PagedPrefillCuda(d.Params(), nullptr, 1, nullptr, nullptr, PrefillKernel::kSm90Fp8Q, nullptr),
              cudaErrorInvalidValue)
        << "round " << round;
  }
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

// The sm80 family's FP8 kernels (Traits::kFp8: raw FP8 stages converted to
// fp16 tiles a block at a time) against the float64 reference over the
// dequantized values, both tile shapes: both formats and query dtypes,
// head_dim 64 / 128 / 256, page sizes 1 .. 128, GQA, per-layer and per-head
// scales, every variant, negative scales; the heuristic's plan and plans
// split to min_chunk (the merge family). A batch read without its scales
// fails.
TEST(Fp8Cuda, Sm80PrefillMatchesReferenceOverDequantizedValues) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(8080);
  int split = 0;
  for (int round = 0; round < 36; ++round) {
    const HostBatch b = MakeFp8PrefillBatch(round, &rng, /*with_256=*/true);
    const PrefillKernel k = round % 2 == 0 ? PrefillKernel::kSm80 : PrefillKernel::kSm80Rows64;
    gpu_test::PrefillRun run;
    if (round % 3 == 1) {
      run.force_split = true;
      run.min_chunk = 256;
    }
    const gpu_test::RunResult r = gpu_test::RunPrefill(b, k, run);
    EXPECT_EQ(r.error, "") << PrefillKernelName(k) << " round " << round << ": " << gpu_test::Describe(b);
    split += r.split;
    if (round % 6 == 0) {
      run.drop_scales = true;
      const gpu_test::RunResult no_scales = gpu_test::RunPrefill(b, k, run);
      EXPECT_NE(no_scales.error, "") << "round " << round << " matched without its scales";
    }
  }
  EXPECT_GT(split, 3);
}

// The wgmma family's other kernels (kSm90, kSm90OverlapNoPp, which only the
// kernel bench and the tests run) refuse FP8 pools.
TEST(Fp8Cuda, OtherPrefillKernelsRefuseFp8Pools) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(81);
  HostBatch b = MakeFp8Batch(0, &rng);
  std::string err;
  gpu_test::DeviceBatch d(b, &err);
  ASSERT_EQ(err, "");
  for (PrefillKernel k : {PrefillKernel::kSm90, PrefillKernel::kSm90OverlapNoPp}) {
    PrefillWorkItem* items = nullptr;
    EXPECT_EQ(PagedPrefillCuda(d.Params(), items, 1, nullptr, nullptr, k, nullptr), cudaErrorInvalidValue)
        << "kernel " << static_cast<int>(k);
  }
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
}

// ---- CudaBackend on an FP8 cache.

BackendOptions Fp8Options(const KvGeometry& g) {
  BackendOptions o;
  o.kind = "cuda";
  o.geometry = g;
  o.max_batch_rows = 4096;
  o.max_batch_kv_indices = 1 << 16;
  o.max_batch_append_rows = 1024;
  return o;
}

absl::Status RunBatch(Backend& backend, absl::Span<const PrefillTask> tasks) {
  BatchStats stats;
  absl::Status st = backend.Submit(tasks, &stats);
  if (!st.ok()) return st;
  return backend.Complete(&stats);
}

// Quantizes 16-bit rows of `layer` into host FP8 rows with the batch's
// scales (what the backend must store).
std::vector<uint8_t> HostQuantize(const HostBatch& b, int layer, const std::vector<uint16_t>& rows,
                                  const std::vector<float>& scales) {
  const KvGeometry& g = b.geo;
  std::vector<uint8_t> out(rows.size());
  for (size_t e = 0; e < rows.size(); ++e) {
    const float s = scales[int64_t{layer} * g.num_kv_heads + int64_t(e % g.RowElems()) / g.head_dim];
    out[e] = Fp8Quantize(g.kv_fp8, float(gpu_test::FromHalfBits(g.dtype, rows[e])), s);
  }
  return out;
}

TEST(Fp8CudaBackend, WriteReadScalesAndBatchesMatchReference) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(3232);
  for (int round = 0; round < 4; ++round) {
    HostBatch pools;
    KvGeometry& g = pools.geo;
    g.head_dim = round % 2 == 0 ? 128 : 64;
    g.page_size = round < 2 ? 16 : 1;
    g.num_kv_heads = 2;
    g.num_qo_heads = 8;
    g.num_layers = 2;
    g.num_pages = 3000 / g.page_size;
    g.dtype = round % 3 == 0 ? KvDType::kBf16 : KvDType::kFp16;
    gpu_test::MakePools(&pools, &rng);
    const std::vector<uint16_t> k16 = pools.k_pool, v16 = pools.v_pool;
    gpu_test::QuantizePools(&pools, round < 2 ? Fp8Format::kE4m3 : Fp8Format::kE5m2, round % 2 == 0, &rng);
    const std::string what = std::string(Fp8FormatName(g.kv_fp8)) + " D=" + std::to_string(g.head_dim) +
                             " ps=" + std::to_string(g.page_size) + " round " + std::to_string(round);

    auto made = MakeCudaBackend(Fp8Options(g));
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<Backend> backend = std::move(made).value();
    const int64_t spl = g.SlotsPerLayer(), re = g.RowElems();
    for (int layer = 0; layer < g.num_layers; ++layer) {
      const auto at = pools.k_scales.begin() + int64_t{layer} * g.num_kv_heads;
      const auto vt = pools.v_scales.begin() + int64_t{layer} * g.num_kv_heads;
      ASSERT_TRUE(backend
                      ->SetKvScales(layer, std::vector<float>(at, at + g.num_kv_heads),
                                    std::vector<float>(vt, vt + g.num_kv_heads))
                      .ok());
    }
    // 16-bit rows, quantized on the device: the stored bytes equal the host
    // quantizer's (pools.k8 / v8), read back raw and dequantized.
    std::vector<int64_t> slots(spl);
    for (int64_t i = 0; i < spl; ++i) slots[i] = i;
    for (int layer = 0; layer < g.num_layers; ++layer) {
      KvRows w;
      w.layer = layer;
      w.slots = slots.data();
      w.n = spl;
      w.k = const_cast<uint16_t*>(k16.data()) + layer * spl * re;
      w.v = const_cast<uint16_t*>(v16.data()) + layer * spl * re;
      ASSERT_TRUE(backend->WriteKv(w, nullptr).ok()) << what;
      std::vector<uint8_t> rk(spl * re, 0xAB), rv(spl * re, 0xAB);
      KvRows r = w;
      r.k = rk.data();
      r.v = rv.data();
      r.rows_fp8 = true;
      ASSERT_TRUE(backend->ReadKv(r, nullptr).ok()) << what;
      int64_t k_diff = 0, v_diff = 0;
      for (int64_t e = 0; e < spl * re; ++e) {
        k_diff += rk[e] != pools.k8[layer * spl * re + e];
        v_diff += rv[e] != pools.v8[layer * spl * re + e];
      }
      EXPECT_EQ(k_diff, 0) << what << " layer " << layer << ": stored K bytes differ from the host quantizer";
      EXPECT_EQ(v_diff, 0) << what << " layer " << layer;
      std::vector<uint16_t> dk(spl * re, 0xFFFF), dv(spl * re, 0xFFFF);
      r.k = dk.data();
      r.v = dv.data();
      r.rows_fp8 = false;
      ASSERT_TRUE(backend->ReadKv(r, nullptr).ok()) << what;
      int64_t dk_diff = 0, dv_diff = 0;
      for (int64_t e = 0; e < spl * re; ++e) {
        const int64_t si = int64_t{layer} * g.num_kv_heads + (e % re) / g.head_dim;
        const int64_t pe = layer * spl * re + e;
        dk_diff += dk[e] != FloatToHalf(g.dtype, Fp8ToFloat(g.kv_fp8, pools.k8[pe]) * pools.k_scales[si]);
        dv_diff += dv[e] != FloatToHalf(g.dtype, Fp8ToFloat(g.kv_fp8, pools.v8[pe]) * pools.v_scales[si]);
      }
      EXPECT_EQ(dk_diff, 0) << what << " layer " << layer << ": dequantized K rows differ";
      EXPECT_EQ(dv_diff, 0) << what << " layer " << layer;
    }

    // A batch: one task per layer, decode rows and prefill rows, fused
    // appends of 16-bit rows (task 0) and of FP8 rows as stored (task 1).
    std::vector<HostBatch> parts(2);
    std::vector<PrefillTask> tasks(2);
    std::vector<std::vector<uint16_t>> outs(2), app16(2);
    std::vector<std::vector<uint8_t>> app8(2);
    std::vector<std::vector<float>> lses(2);
    std::vector<std::vector<int64_t>> app_slots(2);
    for (int t = 0; t < 2; ++t) {
      HostBatch& p = parts[t];
      p.geo = g;
      const int nseq = 2 + static_cast<int>(rng() % 4);
      for (int s = 0; s < nseq; ++s) {
        const int q_len = s == 0 ? 9 + static_cast<int>(rng() % 60) : 1 + static_cast<int>(rng() % 8);
        const int kv_len = q_len + static_cast<int>(rng() % 2500);
        gpu_test::AddSeq(&p, q_len, kv_len, t, rng() % 4 != 0, rng() % 2 == 0,
                         1 / std::sqrt(float(g.head_dim)), &rng);
      }
      gpu_test::FinishBatch(&p, 1.f, &rng);
      // Appends: the last rows' slots of the first sequence (its own pages).
      const PrefillSeq& s0 = p.seqs[0];
      const int n_app = std::min(s0.q_len, 16);
      for (int i = 0; i < n_app; ++i) {
        const int pos = s0.kv_len - n_app + i;
        app_slots[t].push_back(int64_t{p.kv_indices[s0.kv_start + pos / g.page_size]} * g.page_size +
                               pos % g.page_size);
      }
      std::sort(app_slots[t].begin(), app_slots[t].end());
      app_slots[t].erase(std::unique(app_slots[t].begin(), app_slots[t].end()), app_slots[t].end());
      const int64_t n = static_cast<int64_t>(app_slots[t].size());
      PrefillTask& task = tasks[t];
      task.layer = t;
      task.q = p.q.data();
      task.total_q = p.total_q;
      task.seqs = p.seqs;
      task.kv_indices = p.kv_indices.data();
      task.num_kv_indices = static_cast<int32_t>(p.kv_indices.size());
      task.append_slots = app_slots[t].data();
      task.num_append = n;
      if (t == 0) {
        app16[t].resize(2 * n * re);
        gpu_test::FillRandom(&app16[t], g.dtype, 1.f, &rng);
        task.append_k = app16[t].data();
        task.append_v = app16[t].data() + n * re;
      } else {
        app8[t].resize(2 * n * re);
        // Random bytes with the exponent's top bit clear: |value| < 2, never
        // NaN or infinite, subnormals included.
        for (auto& x : app8[t]) x = static_cast<uint8_t>(rng() & 0xBF);
        task.append_k = app8[t].data();
        task.append_v = app8[t].data() + n * re;
        task.append_fp8 = true;
      }
      outs[t].assign(size_t(p.total_q) * g.num_qo_heads * g.head_dim, 0xFFFF);
      lses[t].assign(size_t(p.total_q) * g.num_qo_heads, NAN);
      task.o = outs[t].data();
      task.lse = lses[t].data();
      // The host pools after the append.
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t e = 0; e < re; ++e) {
          const int64_t pe = (t * spl + app_slots[t][i]) * re + e;
          const int64_t si = int64_t{t} * g.num_kv_heads + e / g.head_dim;
          if (t == 0) {
            pools.k8[pe] = Fp8Quantize(g.kv_fp8, float(gpu_test::FromHalfBits(g.dtype, app16[t][i * re + e])),
                                       pools.k_scales[si]);
            pools.v8[pe] = Fp8Quantize(g.kv_fp8,
                                       float(gpu_test::FromHalfBits(g.dtype, app16[t][(n + i) * re + e])),
                                       pools.v_scales[si]);
          } else {
            pools.k8[pe] = app8[t][i * re + e];
            pools.v8[pe] = app8[t][(n + i) * re + e];
          }
        }
      }
    }
    ASSERT_TRUE(RunBatch(*backend, tasks).ok()) << what;
    for (int t = 0; t < 2; ++t) {
      HostBatch& p = parts[t];
      p.k8 = pools.k8;
      p.v8 = pools.v8;
      p.k_scales = pools.k_scales;
      p.v_scales = pools.v_scales;
      std::vector<double> o_ref, lse_ref;
      gpu_test::Reference(p, &o_ref, &lse_ref);
      EXPECT_EQ(gpu_test::Compare(g.dtype, outs[t], lses[t], o_ref, lse_ref), "") << what << " task " << t;
      p.k8.clear();
      p.v8.clear();
    }
  }
}


// The CUDA backend with --prefill_kernel=sm90_fp8q on an E4M3 cache:
// sequences of more than 8 query rows run on kSm90Fp8Q (their queries
// rounded to E4M3), decode-sized ones on the decode family (queries kept in
// 16 bits). One batch against the float64 reference over exactly that; the
// same outputs fail the reference over the queries as sent (so the FP8-query
// kernel did run).
TEST(Fp8CudaBackend, Fp8QueriesFamilyRoundsPrefillRowsOnly) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  if (!Sm90PrefillSupported()) GTEST_SKIP() << "needs an sm_90 device";
  std::mt19937_64 rng(4242);
  HostBatch pools;
  KvGeometry& g = pools.geo;
  g.head_dim = 128;
  g.page_size = 16;
  g.num_kv_heads = 2;
  g.num_qo_heads = 8;
  g.num_layers = 1;
  g.num_pages = 4000 / g.page_size;
  g.dtype = KvDType::kBf16;
  gpu_test::MakePools(&pools, &rng);
  const std::vector<uint16_t> k16 = pools.k_pool, v16 = pools.v_pool;
  gpu_test::QuantizePools(&pools, Fp8Format::kE4m3, /*per_head=*/true, &rng);
  BackendOptions options = Fp8Options(g);
  options.prefill_family = PrefillFamily::kSm90Fp8Q;
  auto made = MakeCudaBackend(options);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<Backend> backend = std::move(made).value();
  ASSERT_TRUE(backend->SetKvScales(0, pools.k_scales, pools.v_scales).ok());
  const int64_t spl = g.SlotsPerLayer();
  std::vector<int64_t> slots(spl);
  for (int64_t i = 0; i < spl; ++i) slots[i] = i;
  KvRows w;
  w.layer = 0;
  w.slots = slots.data();
  w.n = spl;
  w.k = const_cast<uint16_t*>(k16.data());
  w.v = const_cast<uint16_t*>(v16.data());
  ASSERT_TRUE(backend->WriteKv(w, nullptr).ok());

  HostBatch p;
  p.geo = g;
  for (int s = 0; s < 6; ++s) {
    const int q_len = s % 2 == 0 ? 9 + static_cast<int>(rng() % 300) : 1 + static_cast<int>(rng() % 8);
    gpu_test::AddSeq(&p, q_len, q_len + static_cast<int>(rng() % 3000), 0, s % 3 != 0, false,
                     (s == 2 ? -1.f : 1.f) / std::sqrt(float(g.head_dim)), &rng);
  }
  gpu_test::FinishBatch(&p, 1.f, &rng);
  p.k8 = pools.k8;
  p.v8 = pools.v8;
  p.k_scales = pools.k_scales;
  p.v_scales = pools.v_scales;
  // The reference's queries: rounded for the prefill rows (the backend's
  // Fp8QueryMinRows: 9, the decode family taking the shorter ones), as sent
  // for the decode rows.
  const int min_rows = backend->Fp8QueryMinRows();
  ASSERT_EQ(min_rows, 9);
  int rounded_rows = 0;
  for (const PrefillSeq& s : p.seqs) rounded_rows += s.q_len >= min_rows ? s.q_len : 0;
  ASSERT_GT(rounded_rows, 0);
  const size_t row_elems = size_t(g.num_qo_heads) * g.head_dim;
  PrefillTask task;
  task.layer = 0;
  task.q = p.q.data();
  task.total_q = p.total_q;
  task.seqs = p.seqs;
  task.kv_indices = p.kv_indices.data();
  task.num_kv_indices = static_cast<int32_t>(p.kv_indices.size());
  std::vector<uint16_t> out(size_t(p.total_q) * row_elems, 0xFFFF);
  std::vector<float> lse(size_t(p.total_q) * g.num_qo_heads, NAN);
  task.o = out.data();
  task.lse = lse.data();
  const PrefillTask tasks[] = {task};
  ASSERT_TRUE(RunBatch(*backend, tasks).ok());
  std::vector<double> o_ref, lse_ref, lse_bound;
  gpu_test::Reference(p, &o_ref, &lse_ref, min_rows, &lse_bound);
  EXPECT_EQ(gpu_test::Compare(g.dtype, out, lse, o_ref, lse_ref, 1e-3, &lse_bound), "");
  gpu_test::Reference(p, &o_ref, &lse_ref);
  EXPECT_NE(gpu_test::Compare(g.dtype, out, lse, o_ref, lse_ref), "")
      << "matched the reference over unrounded queries: the FP8-query kernel did not run";
}

}  // namespace
}  // namespace attnserve
