// The decode kernel family (kernels/decode/decode_cuda.h) with its host plan,
// on random data against the float64 reference of gpu_test_util.h. Outputs,
// LSEs and the partial workspace are poisoned with 0xFF bytes (NaN) before
// every run; every batch runs three times on the same split counters, which
// the kernel must leave at zero, and its last two runs (the served launch)
// must give the same bits.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/decode/decode_cuda.h"
#include "kernels/plan/decode_plan.h"
#include "tests/gpu/family_run.h"

namespace attnserve {
namespace {

using gpu_test::HostBatch;

using gpu_test::kNoSplit;
using gpu_test::RunResult;

RunResult RunAndCheck(const HostBatch& b, int force_chunk, int force_cluster = 0) {
  return gpu_test::RunDecode(b, force_chunk, force_cluster);
}

std::string Describe(const HostBatch& b, int force_chunk, bool split) {
  return "force_chunk=" + std::to_string(force_chunk) + (split ? " split " : " ") + gpu_test::Describe(b);
}

float RandomScale(int head_dim, std::mt19937_64* rng) {
  return (0.5f + ((*rng)() % 1000) / 1000.f) / std::sqrt(float(head_dim));
}

TEST(PagedDecodeCuda, RejectsUnsupportedShapes) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  PagedPrefillParams p;
  p.geo.head_dim = 96;
  p.geo.num_qo_heads = 8;
  p.geo.num_kv_heads = 2;
  p.geo.page_size = 16;
  EXPECT_EQ(PagedDecodeCuda(p, 16, nullptr, 1, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  p.geo.head_dim = 128;
  EXPECT_EQ(PagedDecodeCuda(p, 64, nullptr, 1, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  p.geo.head_dim = 256;
  EXPECT_EQ(PagedDecodeCuda(p, 32, nullptr, 1, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(PagedDecodeCuda(p, 16, nullptr, 0, nullptr, nullptr, nullptr, nullptr), cudaSuccess);
  cudaGetLastError();
}

// A random batch: head_dim 64/128/256, GQA 1/4/8/16, page_size 1/16/64,
// bf16/fp16, 1 or 2 layers, 1..max_seqs sequences of 1..8 query rows over 0..5500
// keys, causal or not, some with causal_shift or base-e LSE, random scales.
// long_first: the first sequence sees 300 keys or more.
HostBatch RandomBatch(std::mt19937_64* rng_p, int max_seqs, bool long_first) {
  std::mt19937_64& rng = *rng_p;
  HostBatch b;
  const int dims[] = {64, 128, 128, 256};
  const int heads[][2] = {{4, 4}, {8, 2}, {32, 4}, {16, 2}, {8, 1}, {16, 1}};
  const int page_sizes[] = {1, 16, 64};
  const int* hh = heads[rng() % 6];
  b.geo.head_dim = dims[rng() % 4];
  b.geo.num_qo_heads = hh[0];
  b.geo.num_kv_heads = hh[1];
  b.geo.page_size = page_sizes[rng() % 3];
  b.geo.dtype = rng() % 2 ? KvDType::kBf16 : KvDType::kFp16;
  b.geo.num_layers = 1 + rng() % 2;
  // Small pools keep the host side fast; longer sequences repeat page ids.
  b.geo.num_pages = std::max(8, 2048 / b.geo.page_size);
  gpu_test::MakePools(&b, &rng);
  const int nseq = 1 + rng() % max_seqs;
  for (int s = 0; s < nseq; ++s) {
    const int q_len = 1 + rng() % 8;
    int kv_len = 0;
    switch (rng() % 6) {
      case 0: kv_len = rng() % 3; break;  // 0, 1 or 2 keys
      case 1: kv_len = 3000 + rng() % 2500; break;
      default: kv_len = 1 + rng() % 1500; break;
    }
    if (long_first && s == 0) kv_len = std::max(kv_len, 300 + static_cast<int>(rng() % 700));
    const bool causal = rng() % 4 != 0;
    gpu_test::AddSeq(&b, q_len, kv_len, rng() % b.geo.num_layers, causal, rng() % 3 == 0,
                     RandomScale(b.geo.head_dim, &rng), &rng);
    if (rng() % 3 == 0) b.seqs.back().causal_shift = static_cast<int>(rng() % 41) - 30;
  }
  gpu_test::FinishBatch(&b, rng() % 4 == 0 ? 3.f : 1.f, &rng);
  return b;
}

// Random geometries (head_dim 64/128/256, GQA 1/4/8/16, page_size 1/16/64,
// bf16/fp16), 1..8 query rows, causal or not, causal_shift, base-e LSE, mixed
// layers and scales, sequences with 0 or 1 key. The plan mode rotates so both
// paths are covered by construction: batch it % 3 == 0 never splits, 1 is
// forced into chunks of 64..256 tokens (with one sequence long enough to be
// cut), 2 runs the heuristic with this GPU's SM count.
TEST(PagedDecodeCuda, RandomBatches) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(20261214);
  const int kBatches = 120;
  int splits = 0, unsplit = 0;
  for (int it = 0; it < kBatches; ++it) {
    const int mode = it % 3;
    // A forced split needs a sequence that sees more than one chunk (256
    // tokens at most; causal_shift takes at most 30 away).
    const HostBatch b = RandomBatch(&rng, /*max_seqs=*/6, /*long_first=*/mode == 1);
    const int force_chunk = mode == 0 ? kNoSplit : mode == 1 ? 64 << (rng() % 3) : 0;
    const RunResult r = RunAndCheck(b, force_chunk);
    (r.split ? splits : unsplit)++;
    ASSERT_EQ(r.error, "") << "batch " << it << ": " << Describe(b, force_chunk, r.split);
    if (mode == 0) EXPECT_FALSE(r.split) << "batch " << it << ": no_split plan split";
    if (mode == 1) EXPECT_TRUE(r.split) << "batch " << it << ": forced chunks did not split";
  }
  EXPECT_GE(splits, kBatches / 3) << "too few batches exercised split KV";
  EXPECT_GE(unsplit, kBatches / 3) << "too few batches ran unsplit";
}

// Every (page_size, GQA, head_dim, dtype) corner, 1..8 rows causal
// bottom-right, split and unsplit.
TEST(PagedDecodeCuda, GeometryGrid) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(5);
  for (int ps : {1, 16, 64}) {
    for (int group : {1, 4, 8}) {
      for (int d : {64, 128, 256}) {
        for (KvDType dt : {KvDType::kBf16, KvDType::kFp16}) {
          for (int force_chunk : {0, 128}) {
            HostBatch b;
            b.geo.head_dim = d;
            b.geo.num_kv_heads = 2;
            b.geo.num_qo_heads = 2 * group;
            b.geo.page_size = ps;
            b.geo.dtype = dt;
            b.geo.num_layers = 1;
            b.geo.num_pages = std::max(8, 1024 / ps);
            gpu_test::MakePools(&b, &rng);
            for (int q_len = 1; q_len <= 8; ++q_len) {
              gpu_test::AddSeq(&b, q_len, q_len * 97 + 300, 0, true, false, RandomScale(d, &rng), &rng);
            }
            gpu_test::FinishBatch(&b, 1.f, &rng);
            const RunResult r = RunAndCheck(b, force_chunk);
            if (force_chunk > 0) EXPECT_TRUE(r.split);
            ASSERT_EQ(r.error, "") << Describe(b, force_chunk, r.split);
          }
        }
      }
    }
  }
}

// causal_shift != 0: positive (the server holds a middle part of a
// sequence), negative (rows see fewer keys; some none at all), split and not.
TEST(PagedDecodeCuda, CausalShift) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(9);
  for (int force_chunk : {0, 64, 256}) {
    HostBatch b;
    b.geo.head_dim = 128;
    b.geo.num_qo_heads = 16;
    b.geo.num_kv_heads = 2;
    b.geo.page_size = 16;
    b.geo.dtype = KvDType::kBf16;
    b.geo.num_layers = 2;
    b.geo.num_pages = 600;
    gpu_test::MakePools(&b, &rng);
    const int shifts[] = {5, 1000, -1, -3, -7, -300, -2000, 0};
    for (int i = 0; i < 8; ++i) {
      gpu_test::AddSeq(&b, 1 + i % 8, 900 + 13 * i, i % 2, true, i % 3 == 0, RandomScale(128, &rng), &rng);
      b.seqs.back().causal_shift = shifts[i];
    }
    gpu_test::FinishBatch(&b, 2.f, &rng);
    const RunResult r = RunAndCheck(b, force_chunk);
    ASSERT_EQ(r.error, "") << Describe(b, force_chunk, r.split);
  }
}

// Sequences of one key (rows before the diagonal see nothing: 0 and -inf)
// and of no key, beside longer ones.
TEST(PagedDecodeCuda, OneKeyAndEmptySequences) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(13);
  for (int force_chunk : {0, 64}) {
    HostBatch b;
    b.geo.head_dim = 64;
    b.geo.num_qo_heads = 8;
    b.geo.num_kv_heads = 1;
    b.geo.page_size = 1;
    b.geo.dtype = KvDType::kFp16;
    b.geo.num_layers = 1;
    b.geo.num_pages = 3000;
    gpu_test::MakePools(&b, &rng);
    for (int q_len = 1; q_len <= 8; ++q_len) {
      gpu_test::AddSeq(&b, q_len, 1, 0, true, q_len % 2, 0.125f, &rng);
      gpu_test::AddSeq(&b, q_len, 1, 0, false, false, 0.125f, &rng);
      gpu_test::AddSeq(&b, q_len, 0, 0, q_len % 2, false, 0.125f, &rng);
    }
    gpu_test::AddSeq(&b, 2, 2500, 0, true, false, 0.125f, &rng);
    gpu_test::FinishBatch(&b, 1.f, &rng);
    const RunResult r = RunAndCheck(b, force_chunk);
    ASSERT_EQ(r.error, "") << Describe(b, force_chunk, r.split);
  }
}

// A KV range longer than 64k keys (split by the heuristic), beside short
// sequences; mixed layers, scales (one negative) and LSE bases.
TEST(PagedDecodeCuda, LongSequenceMixedLayersAndScales) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(17);
  HostBatch b;
  b.geo.head_dim = 128;
  b.geo.num_qo_heads = 8;
  b.geo.num_kv_heads = 1;
  b.geo.page_size = 16;
  b.geo.dtype = KvDType::kBf16;
  b.geo.num_layers = 3;
  b.geo.num_pages = 4500;  // 72,000 slots per layer
  gpu_test::MakePools(&b, &rng);
  gpu_test::AddSeq(&b, 1, 70001, 2, true, false, 1 / std::sqrt(128.f), &rng);
  gpu_test::AddSeq(&b, 4, 66000, 0, true, true, 0.05f, &rng);
  gpu_test::AddSeq(&b, 8, 65537, 1, false, false, -0.07f, &rng);
  gpu_test::AddSeq(&b, 1, 100, 1, true, false, 0.2f, &rng);
  gpu_test::AddSeq(&b, 3, 3, 0, true, true, 0.09f, &rng);
  gpu_test::FinishBatch(&b, 2.f, &rng);
  const RunResult r = RunAndCheck(b, 0);
  EXPECT_TRUE(r.split) << "a 70k-key decode must be split";
  EXPECT_EQ(r.error, "") << Describe(b, 0, r.split);
  const RunResult unsplit = RunAndCheck(b, 1 << 20);  // chunks longer than any sequence: no split
  EXPECT_FALSE(unsplit.split);
  EXPECT_EQ(unsplit.error, "") << Describe(b, 1 << 20, unsplit.split);
}

// Cluster mode (sm_90: the chunks of a tile are one cluster and merge in
// distributed shared memory): random batches as RandomBatches, each forced
// into clusters of 2, 4, 8 and 16 CTAs, including empty chunks (sequences
// shorter than the cluster's chunks, 0 and 1 keys) and causal_shift.
TEST(PagedDecodeCuda, ClusterMode) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  if (DecodeMaxCluster(128, KvDType::kBf16, 16) < 2) GTEST_SKIP() << "no thread-block clusters on this GPU";
  std::mt19937_64 rng(20261201);
  const int kBatches = 40;
  int clustered = 0;
  for (int it = 0; it < kBatches; ++it) {
    const HostBatch b = RandomBatch(&rng, /*max_seqs=*/4, /*long_first=*/false);
    const int cluster = 2 << (it % 4);  // 2, 4, 8, 16
    const int max_rows = 8 * (b.geo.num_qo_heads / b.geo.num_kv_heads);
    if (cluster > DecodeMaxCluster(b.geo.head_dim, b.geo.dtype, DecodeTileRows(b.geo.head_dim, max_rows))) continue;
    const RunResult r = RunAndCheck(b, 0, cluster);
    ASSERT_EQ(r.error, "") << "batch " << it << " cluster " << cluster << ": " << Describe(b, 0, r.split);
    if (r.cluster == cluster) ++clustered;
  }
  EXPECT_GE(clustered, kBatches / 2) << "too few batches ran in cluster mode";
}

}  // namespace
}  // namespace attnserve
