// The MLA kernel family (kernels/mla/mla_cuda.h) with its host plan against
// the float64 reference of common/reference.h: DeepSeek V3's latent rows
// (512 + 64), 16 and 128 heads, decode (1..8 rows) and prefill batches with
// every edge case (empty sequences, rows that see nothing, partial last
// pages), page sizes 1, 16 and 64, both dtypes, variants (window, soft-cap,
// sinks, LSE bases), with the KV split forced and not, and every tile shape the
// device runs (the wgmma 64 x 64 on sm_90).
// Outputs, LSEs and the split workspace are poisoned before each run; every
// CUDA call is checked. Skips without a GPU.
#include <cuda_runtime.h>

#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/mla/mla_cuda.h"
#include "kernels/plan/mla_plan.h"
#include "tests/gpu/family_run.h"

namespace attnserve {
namespace gpu_test {
namespace {

struct MlaConfig {
  std::string name;
  int32_t heads;
  int32_t page_size;
  KvDType dtype;
  bool decode;    // 1..8 rows per sequence (else prefill up to 40)
  bool variants;  // windows, soft-caps, sinks, causal shifts
};

void PrintTo(const MlaConfig& c, std::ostream* os) { *os << c.name; }

HostBatch MlaBatch(const MlaConfig& c, std::mt19937_64* rng) {
  HostBatch b;
  KvGeometry& g = b.geo;
  g.num_layers = 2;
  g.page_size = c.page_size;
  g.num_pages = c.page_size == 1 ? 8192 : 8192 / c.page_size + 8;
  g.num_qo_heads = c.heads;
  g.num_kv_heads = 1;
  g.attention = AttentionKind::kMla;
  g.kv_lora_rank = kMlaKvLoraRank;
  g.qk_rope_head_dim = kMlaRopeDim;
  g.head_dim = kMlaKvLoraRank + kMlaRopeDim;
  g.dtype = c.dtype;
  b.k_pool.resize(g.PoolElems());  // the latent pool; no V pool
  FillRandom(&b.k_pool, g.dtype, 1.f, rng);
  const float scale = 1.f / std::sqrt(192.f);
  std::uniform_int_distribution<int> q_len(1, c.decode ? 8 : 40), kv_len(1, 1500);
  // Edge cases first: no rows, no keys, more rows than keys, a full last page.
  AddSeq(&b, 0, 300, 0, true, false, scale, rng);
  AddSeq(&b, c.decode ? 1 : 5, 0, 1, true, false, scale, rng);
  AddSeq(&b, c.decode ? 8 : 30, 3, 0, true, true, scale, rng);
  AddSeq(&b, q_len(*rng), 4 * c.page_size * (c.page_size == 1 ? 64 : 1), 1, true, false, scale,
         rng);
  for (int i = 0; i < 6; ++i) {
    AddSeq(&b, q_len(*rng), kv_len(*rng), i % 2, (*rng)() % 5 != 0, (*rng)() % 3 == 0, scale, rng);
  }
  if (c.variants) {
    for (PrefillSeq& s : b.seqs) {
      switch ((*rng)() % 5) {
        case 0: s.window_left = static_cast<int32_t>((*rng)() % 200); break;
        case 1: s.soft_cap = 30.f; break;
        case 2: s.sink_index = AddSinkSet(&b, rng); break;
        case 3: s.causal_shift = static_cast<int32_t>((*rng)() % 40); break;
        default: break;
      }
    }
  }
  FinishBatch(&b, 1.f, rng);
  return b;
}

// Runs the batch through the plan, the kernel and the merge; "" when it
// matches the reference.
std::string RunMla(const HostBatch& b, const MlaPlanOptions& options, bool* split) {
  std::string err;
  const KvGeometry& g = b.geo;
  MlaPlan plan;
  BuildMlaPlan(b.seqs.data(), static_cast<int32_t>(b.seqs.size()), g, options, &plan);
  *split = !plan.merges.empty();
  DeviceBuffer<uint16_t> k(b.k_pool.size(), &err), q(b.q.size(), &err),
      o(size_t(b.total_q) * g.num_qo_heads * g.VDim(), &err);
  DeviceBuffer<float> lse(size_t(b.total_q) * g.num_qo_heads, &err), sinks(b.sinks.size(), &err);
  DeviceBuffer<int32_t> indices(b.kv_indices.size(), &err);
  DeviceBuffer<PrefillSeq> seqs(b.seqs.size(), &err);
  DeviceBuffer<MlaWorkItem> items(plan.items.size(), &err);
  DeviceBuffer<MlaMergeTile> merges(plan.merges.size(), &err);
  DeviceBuffer<float> part_o(size_t(plan.partial_slots) * plan.tile_rows * g.VDim(), &err),
      part_lse(size_t(plan.partial_slots) * plan.tile_rows, &err);
  k.Upload(b.k_pool);
  q.Upload(b.q);
  sinks.Upload(b.sinks);
  indices.Upload(b.kv_indices);
  seqs.Upload(b.seqs);
  items.Upload(plan.items);
  merges.Upload(plan.merges);
  o.Poison();
  lse.Poison();
  part_o.Poison();
  part_lse.Poison();
  if (!err.empty()) return err;
  PagedPrefillParams p;
  p.q = q.ptr;
  p.o = o.ptr;
  p.lse = lse.ptr;
  p.k_cache = k.ptr;
  p.v_cache = k.ptr;
  p.kv_indices = indices.ptr;
  p.seqs = seqs.ptr;
  p.sinks = b.sinks.empty() ? nullptr : sinks.ptr;
  p.num_seqs = static_cast<int32_t>(b.seqs.size());
  p.total_q = b.total_q;
  p.geo = g;
  cudaError_t e = PagedMlaCuda(p, plan.tile_rows, plan.key_block, items.ptr,
                               static_cast<int32_t>(plan.items.size()), part_o.ptr, part_lse.ptr,
                               nullptr);
  if (e != cudaSuccess) return std::string("PagedMlaCuda: ") + cudaGetErrorString(e);
  e = MergeMlaCuda(p, plan.tile_rows, merges.ptr, static_cast<int32_t>(plan.merges.size()),
                   part_o.ptr, part_lse.ptr, nullptr);
  if (e != cudaSuccess) return std::string("MergeMlaCuda: ") + cudaGetErrorString(e);
  if ((e = cudaDeviceSynchronize()) != cudaSuccess) {
    return std::string("kernel: ") + cudaGetErrorString(e);
  }
  const std::vector<uint16_t> got_o = o.Download();
  const std::vector<float> got_lse = lse.Download();
  if (!err.empty()) return err;
  const auto ref = CachedReference(b);
  return Compare(g.dtype, got_o, got_lse, ref->o, ref->lse);
}

class MlaKernelTest : public ::testing::TestWithParam<MlaConfig> {};

TEST_P(MlaKernelTest, MatchesTheReferenceWithAndWithoutSplits) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  const MlaConfig& c = GetParam();
  std::mt19937_64 rng(std::hash<std::string>()(c.name));
  const HostBatch b = MlaBatch(c, &rng);
  const MlaPlanOptions device = MlaPlanOptionsForDevice();
  // Every tile shape the kernel is built for that the device takes (the
  // plan picks the small one only where the rows fit it, so each is forced
  // here as the plan's only tile); the split forced (a "device" of 1000
  // SMs) and not (one of 1 SM).
  struct TileShape {
    int32_t rows, key_block;
  };
  for (const TileShape& shape :
       {TileShape{64, 64}, TileShape{64, 32}, TileShape{16, 64}, TileShape{16, 32}}) {
    ASSERT_GT(MlaTileSmemBytes(shape.rows, shape.key_block), 0);
    if (!MlaTileRuns(shape.rows, shape.key_block)) continue;
    for (int32_t sms : {1, 1000}) {
      MlaPlanOptions options = device;
      options.tile_rows = shape.rows;
      options.key_block = shape.key_block;
      options.small_tile_rows = 0;
      const int32_t tile_rows = shape.rows;
      options.num_sms = sms;
      options.min_chunk_blocks = 1;
      bool split = false;
      const std::string error = RunMla(b, options, &split);
      EXPECT_EQ(error, "") << c.name << " tile_rows " << tile_rows << " sms " << sms;
      // A "device" of 1 SM never splits; one of 1000 splits where the batch
      // fills at most a quarter of its wave (its longest sequences run to
      // hundreds of keys, so chunks shorten the launch; mla_plan_test.cc
      // checks the rule itself).
      int64_t tiles = 0;
      for (const PrefillSeq& s : b.seqs) tiles += (int64_t{s.q_len} * c.heads + tile_rows - 1) / tile_rows;
      if (sms == 1) EXPECT_FALSE(split) << "one SM split";
      if (sms == 1000 && tiles * 4 <= 1000) EXPECT_TRUE(split) << "the plan did not split as asked";
    }
  }
  // The device's own options: the plan picks the tile (16 rows for decode
  // at 16 heads where the device has the small tile).
  bool split = false;
  EXPECT_EQ(RunMla(b, device, &split), "") << c.name << " with the device's options";
}

std::vector<MlaConfig> Configs() {
  std::vector<MlaConfig> out;
  for (int32_t heads : {16, 128}) {
    for (int32_t ps : {1, 16, 64}) {
      for (bool decode : {true, false}) {
        const KvDType dt = (heads + ps) % 2 == 0 ? KvDType::kBf16 : KvDType::kFp16;
        const bool variants = ps != 16;
        out.push_back(MlaConfig{"H" + std::to_string(heads) + "Ps" + std::to_string(ps) +
                                    (decode ? "Decode" : "Prefill") +
                                    (dt == KvDType::kBf16 ? "Bf16" : "Fp16") +
                                    (variants ? "Variants" : ""),
                                heads, ps, dt, decode, variants});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Configs, MlaKernelTest, ::testing::ValuesIn(Configs()),
                         [](const auto& info) { return info.param.name; });

TEST(MlaKernelTest, RefusesGeometriesAndTilesItIsNotBuiltFor) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  PagedPrefillParams p;
  p.geo.attention = AttentionKind::kMla;
  p.geo.kv_lora_rank = kMlaKvLoraRank;
  p.geo.qk_rope_head_dim = kMlaRopeDim;
  p.geo.dtype = KvDType::kBf16;
  EXPECT_EQ(PagedMlaCuda(p, 32, 16, nullptr, 1, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(PagedMlaCuda(p, 64, 16, nullptr, 1, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(MlaTileSmemBytes(64, 16), -1);
  EXPECT_FALSE(MlaTileRuns(64, 16));
  p.geo.kv_lora_rank = 256;
  EXPECT_EQ(PagedMlaCuda(p, 64, 32, nullptr, 1, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(PagedMlaCuda(p, 64, 64, nullptr, 1, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  p.geo.attention = AttentionKind::kGqa;
  EXPECT_EQ(MergeMlaCuda(p, 64, nullptr, 1, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace gpu_test
}  // namespace attnserve
