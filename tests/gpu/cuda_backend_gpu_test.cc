// CudaBackend through the Backend interface: WriteKv / ReadKv, a batch (Submit + Complete) with
// several tasks (layers, fused appends; outputs in the caller's memory or in
// pinned buffers from AllocateOutput) against the float64 reference, launch
// counts, split-KV on a long sequence, pipelined batches (Submit / Complete)
// in submission order, and clean failure without a device. Sequences of
// 1..8 query rows run on the decode kernel family, longer ones on the
// prefill family (one launch each per batch); DecodeAndMixedBatches covers
// that routing (speculative rows, page sizes, split and unsplit, and
// decode_kernel off).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/backend.h"
#include "server/backend/factory.h"
#include "server/backend/cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_util.h"

namespace attnserve {
namespace {

// Submit and Complete of one batch.
absl::Status RunBatch(Backend& backend, absl::Span<const PrefillTask> tasks, BatchStats* stats) {
  absl::Status st = backend.Submit(tasks, stats);
  if (!st.ok()) return st;
  return backend.Complete(stats);
}

using gpu_test::HostBatch;

// Attention launches (all, decode family) a batch of these tasks makes:
// one per family with rows.
std::pair<int, int> ExpectedLaunches(const std::vector<const std::vector<PrefillSeq>*>& task_seqs,
                                     bool decode_kernel = true) {
  bool decode = false, prefill = false;
  for (const auto* seqs : task_seqs) {
    for (const PrefillSeq& s : *seqs) {
      if (s.q_len <= 0) continue;
      if (decode_kernel && s.q_len <= 8) {
        decode = true;
      } else {
        prefill = true;
      }
    }
  }
  return {int(decode) + int(prefill), int(decode)};
}

BackendOptions Options(const KvGeometry& g, PrefillFamily family = PrefillFamily::kAuto) {
  BackendOptions o;
  o.kind = "cuda";
  o.prefill_family = family;
  o.geometry = g;
  o.max_batch_rows = 4096;
  o.max_batch_kv_indices = 1 << 17;
  o.max_batch_append_rows = 1024;
  return o;
}

// Writes the host pools of `b` into the backend's pools, one WriteKv per
// layer (more rows than max_batch_append_rows, so WriteKv chunks them).
absl::Status UploadPools(Backend& backend, HostBatch& b, BatchStats* stats) {
  const int64_t spl = b.geo.SlotsPerLayer();
  const int64_t re = b.geo.RowElems();
  std::vector<int64_t> slots(spl);
  for (int64_t i = 0; i < spl; ++i) slots[i] = i;
  for (int layer = 0; layer < b.geo.num_layers; ++layer) {
    KvRows rows;
    rows.layer = layer;
    rows.slots = slots.data();
    rows.n = spl;
    rows.k = b.k_pool.data() + layer * spl * re;
    rows.v = b.v_pool.data() + layer * spl * re;
    if (absl::Status st = backend.WriteKv(rows, stats); !st.ok()) return st;
  }
  return absl::OkStatus();
}

TEST(CudaBackend, FailsCleanlyWithoutDevice) {
  if (gpu_test::DeviceCount() > 0) {
    // With a device: an impossible pool must fail with a status, not crash.
    KvGeometry g;
    g.num_layers = 1 << 12;
    g.num_pages = 1 << 20;
    g.page_size = 16;
    g.num_qo_heads = 32;
    g.num_kv_heads = 8;
    g.head_dim = 128;
    auto b = MakeCudaBackend(Options(g));
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
    return;
  }
  KvGeometry g;
  g.num_layers = 1;
  g.num_pages = 16;
  g.page_size = 16;
  g.num_qo_heads = 8;
  g.num_kv_heads = 2;
  g.head_dim = 128;
  auto b = MakeCudaBackend(Options(g));
  EXPECT_FALSE(b.ok());
  GTEST_SKIP() << "skipped: no GPU";
}

bool DeviceIsHopper() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  return major == 9;
}

// --prefill_kernel=sm90 off Hopper: Init fails, naming the flag.
TEST(CudaBackend, Sm90FamilyOffHopperFailsAtStart) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  if (DeviceIsHopper()) GTEST_SKIP() << "skipped: this device runs the sm90 family";
  KvGeometry g;
  g.num_layers = 1;
  g.num_pages = 16;
  g.page_size = 16;
  g.num_qo_heads = 8;
  g.num_kv_heads = 2;
  g.head_dim = 128;
  auto b = MakeCudaBackend(Options(g, PrefillFamily::kSm90));
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
  EXPECT_NE(b.status().message().find("--prefill_kernel=sm90"), absl::string_view::npos) << b.status();
}

// The backend end to end once per --prefill_kernel family (sm90: Hopper only).
class CudaBackendFamily : public ::testing::TestWithParam<PrefillFamily> {
 protected:
  void SetUp() override {
    ATTNSERVE_SKIP_WITHOUT_GPU();
    if (GetParam() == PrefillFamily::kSm90 && !DeviceIsHopper()) {
      GTEST_SKIP() << "skipped: the sm90 family needs an sm_90 device";
    }
  }
};

TEST_P(CudaBackendFamily, WriteReadAndBatchedPrefillMatchReference) {
  std::mt19937_64 rng(99);
  int pinned_tasks = 0;  // tasks whose outputs were downloaded directly
  for (int round = 0; round < 24; ++round) {
    HostBatch b;
    const int dims[] = {64, 128, 256};
    b.geo.head_dim = dims[round % 3];
    b.geo.num_qo_heads = round % 2 ? 32 : 8;
    b.geo.num_kv_heads = round % 4 < 2 ? 4 : 8;
    if (b.geo.num_qo_heads < b.geo.num_kv_heads) b.geo.num_kv_heads = b.geo.num_qo_heads;
    const int page_sizes[] = {1, 16, 64};
    b.geo.page_size = page_sizes[(round / 3) % 3];
    b.geo.dtype = round % 5 < 3 ? KvDType::kBf16 : KvDType::kFp16;
    b.geo.num_layers = 3;
    b.geo.num_pages = 2048 / b.geo.page_size + 8;
    gpu_test::MakePools(&b, &rng);
    auto made = MakeCudaBackend(Options(b.geo, GetParam()));
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<Backend> backend = std::move(made).value();
    EXPECT_EQ(backend->Name(), "cuda");

    // Fill the device pools with the host pools through WriteKv.
    const int64_t spl = b.geo.SlotsPerLayer();
    const int64_t re = b.geo.RowElems();
    BatchStats wstats;
    ASSERT_TRUE(UploadPools(*backend, b, &wstats).ok());
    EXPECT_GT(wstats.kv_rows_launches, 0);

    // Tasks: each its own request (layer, seqs, indices), plus a fused append
    // on the first task that overwrites some slots of its layer.
    const int ntasks = 1 + rng() % 4;
    std::vector<HostBatch> parts(ntasks);
    std::vector<PrefillTask> tasks(ntasks);
    std::vector<std::vector<uint16_t>> outs(ntasks);
    std::vector<std::vector<float>> lses(ntasks);
    std::vector<HostBuffer> bufs(ntasks);
    std::vector<int64_t> app_slots;
    std::vector<uint16_t> app_k, app_v;
    for (int t = 0; t < ntasks; ++t) {
      HostBatch& p = parts[t];
      p.geo = b.geo;
      const int layer = rng() % b.geo.num_layers;
      const int nseq = 1 + rng() % 4;
      for (int s = 0; s < nseq; ++s) {
        int q_len = 1 + rng() % 100;
        int kv_len = rng() % 3 == 0 ? static_cast<int>(rng() % 50) : q_len + static_cast<int>(rng() % 800);
        if (rng() % 6 == 0) q_len = 0;
        gpu_test::AddSeq(&p, q_len, kv_len, layer, rng() % 4 != 0, rng() % 3 == 0,
                         1 / std::sqrt(float(b.geo.head_dim)), &rng);
      }
      gpu_test::FinishBatch(&p, 1.f, &rng);
      PrefillTask& task = tasks[t];
      task.layer = layer;
      task.q = p.q.data();
      task.total_q = p.total_q;
      task.seqs = p.seqs;
      task.kv_indices = p.kv_indices.data();
      task.num_kv_indices = static_cast<int32_t>(p.kv_indices.size());
      outs[t].assign(size_t(p.total_q) * b.geo.num_qo_heads * b.geo.head_dim, 0xFFFF);
      lses[t].assign(size_t(p.total_q) * b.geo.num_qo_heads, NAN);
      task.o = outs[t].data();
      task.lse = lses[t].data();
      if (rng() % 2 == 0 && p.total_q > 0) {
        // As the core does: one buffer from the backend, o then lse, poisoned;
        // the larger ones are pinned and downloaded into directly.
        const int64_t o_bytes = int64_t(outs[t].size()) * 2;
        bufs[t] = backend->AllocateOutput(o_bytes + int64_t(lses[t].size()) * 4);
        ASSERT_NE(bufs[t].data(), nullptr);
        std::memset(bufs[t].data(), 0xFF, bufs[t].size());
        task.o = bufs[t].data();
        task.lse = reinterpret_cast<float*>(bufs[t].data() + o_bytes);
        task.out_pinned = bufs[t].pinned();
        pinned_tasks += task.out_pinned ? 1 : 0;
      }
    }
    {
      const int n = 1 + rng() % 200;
      for (int i = 0; i < n; ++i) app_slots.push_back(rng() % spl);
      app_slots.push_back(app_slots[0]);  // a repeated slot: the last write wins
      app_k.resize(app_slots.size() * re);
      app_v.resize(app_slots.size() * re);
      gpu_test::FillRandom(&app_k, b.geo.dtype, 1.f, &rng);
      gpu_test::FillRandom(&app_v, b.geo.dtype, 1.f, &rng);
      tasks[0].append_slots = app_slots.data();
      tasks[0].num_append = static_cast<int64_t>(app_slots.size());
      tasks[0].append_k = app_k.data();
      tasks[0].append_v = app_v.data();
      const int64_t base = int64_t{tasks[0].layer} * spl;
      for (size_t i = 0; i < app_slots.size(); ++i) {
        std::memcpy(&b.k_pool[(base + app_slots[i]) * re], &app_k[i * re], re * 2);
        std::memcpy(&b.v_pool[(base + app_slots[i]) * re], &app_v[i * re], re * 2);
      }
    }
    BatchStats stats;
    absl::Status st = RunBatch(*backend, tasks, &stats);
    ASSERT_TRUE(st.ok()) << st;
    std::vector<const std::vector<PrefillSeq>*> all_seqs;
    for (const PrefillTask& t : tasks) all_seqs.push_back(&t.seqs);
    const auto [launches, decode_launches] = ExpectedLaunches(all_seqs);
    EXPECT_EQ(stats.attention_launches, launches);
    EXPECT_EQ(stats.attention_decode_launches, decode_launches);
    EXPECT_LE(stats.merge_launches, 1);
    EXPECT_EQ(stats.append_launches, 1);
    for (int t = 0; t < ntasks; ++t) {
      if (bufs[t].data() != nullptr) {
        std::memcpy(outs[t].data(), tasks[t].o, outs[t].size() * 2);
        std::memcpy(lses[t].data(), tasks[t].lse, lses[t].size() * 4);
      }
      HostBatch& p = parts[t];
      p.k_pool = b.k_pool;
      p.v_pool = b.v_pool;
      std::vector<double> o_ref, lse_ref;
      gpu_test::Reference(p, &o_ref, &lse_ref);
      EXPECT_EQ(gpu_test::Compare(b.geo.dtype, outs[t], lses[t], o_ref, lse_ref), "")
          << "round " << round << " task " << t << " D=" << b.geo.head_dim << " ps=" << b.geo.page_size;
    }

    // ReadKv returns what the pools hold (including the fused append).
    KvRows rd;
    rd.layer = tasks[0].layer;
    std::vector<int64_t> rs(app_slots.begin(), app_slots.end());
    rs.push_back(spl - 1);
    rd.slots = rs.data();
    rd.n = static_cast<int64_t>(rs.size());
    std::vector<uint16_t> rk(rs.size() * re, 0xFFFF), rv(rs.size() * re, 0xFFFF);
    rd.k = rk.data();
    rd.v = rv.data();
    ASSERT_TRUE(backend->ReadKv(rd, nullptr).ok());
    const int64_t base = int64_t{rd.layer} * spl;
    for (size_t i = 0; i < rs.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(&rk[i * re], &b.k_pool[(base + rs[i]) * re], re * 2)) << "row " << i;
      ASSERT_EQ(0, std::memcmp(&rv[i * re], &b.v_pool[(base + rs[i]) * re], re * 2)) << "row " << i;
    }
  }
  EXPECT_GT(pinned_tasks, 0) << "no batch downloaded into a pinned response buffer";
}

INSTANTIATE_TEST_SUITE_P(Families, CudaBackendFamily,
                         ::testing::Values(PrefillFamily::kAuto, PrefillFamily::kSm90),
                         [](const ::testing::TestParamInfo<PrefillFamily>& info) {
                           return std::string(PrefillFamilyName(info.param));
                         });

// One long sequence: 4 query rows run on the decode family (split, merged
// inside its one launch), 16 rows on the prefill family (split, then one
// merge launch).
TEST(CudaBackend, LongKvSplitsAndMergesOnce) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  for (int q_len : {4, 16}) {
    std::mt19937_64 rng(123 + q_len);
    HostBatch b;
    b.geo.head_dim = 128;
    b.geo.num_qo_heads = 32;
    b.geo.num_kv_heads = 4;
    b.geo.page_size = 1;
    b.geo.dtype = KvDType::kBf16;
    b.geo.num_layers = 1;
    b.geo.num_pages = 70000;
    gpu_test::MakePools(&b, &rng);
    auto made = MakeCudaBackend(Options(b.geo));
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<Backend> backend = std::move(made).value();
    ASSERT_TRUE(UploadPools(*backend, b, nullptr).ok());
    gpu_test::AddSeq(&b, q_len, 69000, 0, true, false, 1 / std::sqrt(128.f), &rng);
    gpu_test::FinishBatch(&b, 1.f, &rng);
    PrefillTask task;
    task.q = b.q.data();
    task.total_q = b.total_q;
    task.seqs = b.seqs;
    task.kv_indices = b.kv_indices.data();
    task.num_kv_indices = static_cast<int32_t>(b.kv_indices.size());
    std::vector<uint16_t> o(size_t(b.total_q) * 32 * 128, 0xFFFF);
    std::vector<float> lse(size_t(b.total_q) * 32, NAN);
    task.o = o.data();
    task.lse = lse.data();
    BatchStats stats;
    ASSERT_TRUE(RunBatch(*backend, {task}, &stats).ok());
    EXPECT_EQ(stats.attention_launches, 1);
    EXPECT_EQ(stats.attention_decode_launches, q_len <= 8 ? 1 : 0);
    EXPECT_EQ(stats.merge_launches, q_len <= 8 ? 0 : 1);  // the decode family merges in its launch
    EXPECT_GT(stats.attention_seconds, 0);
    std::vector<double> o_ref, lse_ref;
    gpu_test::Reference(b, &o_ref, &lse_ref);
    EXPECT_EQ(gpu_test::Compare(b.geo.dtype, o, lse, o_ref, lse_ref), "") << "q_len " << q_len;
  }
}

// Decode-only and mixed decode + prefill batches through the backend: page
// sizes 1 / 16 / 64, 1..8 query rows (speculative decode), GQA, both
// dtypes, short (unsplit) and long (split) KV, several tasks per batch;
// every output against the float64 reference, and the launch counts of each
// family. Every fourth round runs with decode_kernel off (all on prefill).
TEST(CudaBackend, DecodeAndMixedBatchesWithVariantsMatchReference) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(1414);
  int decode_batches = 0, mixed_batches = 0, split_like = 0;
  for (int round = 0; round < 12; ++round) {
    HostBatch pools;
    const int dims[] = {128, 64, 256};
    pools.geo.head_dim = dims[round % 3];
    const int page_sizes[] = {1, 16, 64};
    pools.geo.page_size = page_sizes[(round / 3) % 3];
    pools.geo.num_kv_heads = round % 2 ? 2 : 4;
    pools.geo.num_qo_heads = pools.geo.num_kv_heads * (round % 4 < 2 ? 4 : 1);
    pools.geo.dtype = round % 5 < 3 ? KvDType::kBf16 : KvDType::kFp16;
    pools.geo.num_layers = 2;
    pools.geo.num_pages = 10000 / pools.geo.page_size + 8;
    gpu_test::MakePools(&pools, &rng);
    BackendOptions opt = Options(pools.geo);
    opt.decode_kernel = round % 4 != 3;
    auto made = MakeCudaBackend(opt);
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<Backend> backend = std::move(made).value();
    ASSERT_TRUE(UploadPools(*backend, pools, nullptr).ok());

    const bool mixed = round % 2 == 1;
    const int ntasks = 1 + rng() % 3;
    std::vector<HostBatch> parts(ntasks);
    std::vector<PrefillTask> tasks(ntasks);
    std::vector<std::vector<uint16_t>> outs(ntasks);
    std::vector<std::vector<float>> lses(ntasks);
    std::vector<const std::vector<PrefillSeq>*> all_seqs;
    for (int t = 0; t < ntasks; ++t) {
      HostBatch& p = parts[t];
      p.geo = pools.geo;
      const int layer = rng() % 2;
      const int nseq = 1 + rng() % 5;
      // Variants (docs/design.md, "Variants"): some tasks carry a sink set
      // (the packer rebases each task's to the batch's), sequences draw
      // windows and soft-caps.
      const bool task_sinks = rng() % 2 == 0;
      if (task_sinks) gpu_test::AddSinkSet(&p, &rng);
      for (int s = 0; s < nseq; ++s) {
        const int q_len = (mixed && s == 0 && t == 0) ? 9 + rng() % 120 : 1 + rng() % 8;
        int kv_len = rng() % 3 == 0 ? 4000 + static_cast<int>(rng() % 5000) : 1 + static_cast<int>(rng() % 2000);
        if (q_len > 8) kv_len = q_len + static_cast<int>(rng() % 600);
        gpu_test::AddSeq(&p, q_len, kv_len, layer, rng() % 4 != 0, rng() % 3 == 0,
                         1 / std::sqrt(float(pools.geo.head_dim)), &rng);
        if (rng() % 4 == 0) p.seqs.back().causal_shift = static_cast<int>(rng() % 21) - 10;
        if (rng() % 3 == 0) p.seqs.back().window_left = static_cast<int>(rng() % 700);
        if (rng() % 3 == 0) p.seqs.back().soft_cap = 30.f;
        if (task_sinks && rng() % 3 != 0) p.seqs.back().sink_index = 0;
        split_like += kv_len >= 4000;
      }
      gpu_test::FinishBatch(&p, 1.f, &rng);
      PrefillTask& task = tasks[t];
      task.layer = layer;
      task.q = p.q.data();
      task.total_q = p.total_q;
      task.seqs = p.seqs;
      task.sinks = p.sinks.empty() ? nullptr : p.sinks.data();
      task.kv_indices = p.kv_indices.data();
      task.num_kv_indices = static_cast<int32_t>(p.kv_indices.size());
      outs[t].assign(size_t(p.total_q) * pools.geo.num_qo_heads * pools.geo.head_dim, 0xFFFF);  // poison
      lses[t].assign(size_t(p.total_q) * pools.geo.num_qo_heads, NAN);
      task.o = outs[t].data();
      task.lse = lses[t].data();
      all_seqs.push_back(&tasks[t].seqs);
    }
    std::vector<std::vector<double>> o_refs(ntasks), lse_refs(ntasks);
    for (int t = 0; t < ntasks; ++t) {
      HostBatch& p = parts[t];
      p.k_pool = pools.k_pool;
      p.v_pool = pools.v_pool;
      gpu_test::Reference(p, &o_refs[t], &lse_refs[t]);
      p.k_pool.clear();
      p.v_pool.clear();
    }
    // Twice on one backend: the decode split counters must be left at zero.
    for (int rep = 0; rep < 2; ++rep) {
      for (int t = 0; t < ntasks; ++t) {
        std::fill(outs[t].begin(), outs[t].end(), 0xFFFF);
        std::fill(lses[t].begin(), lses[t].end(), NAN);
      }
      BatchStats stats;
      const absl::Status st = RunBatch(*backend, tasks, &stats);
      ASSERT_TRUE(st.ok()) << st;
      const auto [launches, decode_launches] = ExpectedLaunches(all_seqs, opt.decode_kernel);
      EXPECT_EQ(stats.attention_launches, launches) << "round " << round;
      EXPECT_EQ(stats.attention_decode_launches, decode_launches) << "round " << round;
      if (decode_launches > 0) EXPECT_GT(stats.attention_decode_seconds, 0);
      EXPECT_GE(stats.attention_seconds, stats.attention_decode_seconds);
      for (int t = 0; t < ntasks; ++t) {
        EXPECT_EQ(gpu_test::Compare(pools.geo.dtype, outs[t], lses[t], o_refs[t], lse_refs[t]), "")
            << "round " << round << " rep " << rep << " task " << t << " D=" << pools.geo.head_dim
            << " ps=" << pools.geo.page_size << (mixed ? " mixed" : " decode")
            << (opt.decode_kernel ? "" : " decode_kernel=off");
      }
    }
    (mixed ? mixed_batches : decode_batches)++;
  }
  EXPECT_EQ(decode_batches, 6);
  EXPECT_EQ(mixed_batches, 6);
  EXPECT_GT(split_like, 3) << "too few long (split) KV sequences";
}

// Two batches in flight: batch B's fused append overwrites KV that batch A
// reads. A must see the old rows and B the new ones (the compute stream keeps
// submission order), both against the float64 reference; a third Submit and
// a ReadKv while batches are in flight are refused.
TEST(CudaBackend, ZeroPagesClearsExactlyTheListedPagesInEveryLayer) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(5);
  for (int page_size : {1, 16}) {
    for (int head_dim : {64, 256}) {
      HostBatch b;
      b.geo.page_size = page_size;
      b.geo.head_dim = head_dim;
      b.geo.num_qo_heads = 8;
      b.geo.num_kv_heads = 2;
      b.geo.num_layers = 3;
      b.geo.num_pages = 4096 / page_size + 5;
      gpu_test::MakePools(&b, &rng);
      auto made = MakeCudaBackend(Options(b.geo));
      ASSERT_TRUE(made.ok()) << made.status();
      std::unique_ptr<Backend> backend = std::move(made).value();
      ASSERT_TRUE(UploadPools(*backend, b, nullptr).ok());
      // A random third of the pages, shuffled, the last page among them.
      std::vector<int32_t> pages;
      for (int32_t p = 0; p < b.geo.num_pages; ++p) {
        if (rng() % 3 == 0 || p == b.geo.num_pages - 1) pages.push_back(p);
      }
      std::shuffle(pages.begin(), pages.end(), rng);
      BatchStats stats;
      ASSERT_TRUE(backend->ZeroPages(pages, &stats).ok());
      EXPECT_GE(stats.zero_launches, 1);
      std::vector<bool> zeroed(b.geo.num_pages, false);
      for (int32_t p : pages) zeroed[p] = true;
      // Read every row back: listed pages are zero, all others unchanged.
      const int64_t spl = b.geo.SlotsPerLayer(), re = b.geo.RowElems();
      std::vector<int64_t> slots(spl);
      for (int64_t i = 0; i < spl; ++i) slots[i] = i;
      std::vector<uint16_t> k(spl * re), v(spl * re);
      for (int layer = 0; layer < b.geo.num_layers; ++layer) {
        KvRows rd;
        rd.layer = layer;
        rd.slots = slots.data();
        rd.n = spl;
        rd.k = k.data();
        rd.v = v.data();
        ASSERT_TRUE(backend->ReadKv(rd, nullptr).ok());
        for (int64_t slot = 0; slot < spl; ++slot) {
          const bool z = zeroed[slot / page_size];
          for (int64_t e = 0; e < re; ++e) {
            const size_t at = size_t(slot * re + e);
            const uint16_t want_k = z ? 0 : b.k_pool[layer * spl * re + at];
            const uint16_t want_v = z ? 0 : b.v_pool[layer * spl * re + at];
            ASSERT_EQ(k[at], want_k) << "layer " << layer << " slot " << slot << " ps " << page_size;
            ASSERT_EQ(v[at], want_v) << "layer " << layer << " slot " << slot << " ps " << page_size;
          }
        }
      }
    }
  }
}

TEST(CudaBackend, PipelinedBatchesKeepSubmissionOrder) {
  ATTNSERVE_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(321);
  for (int round = 0; round < 6; ++round) {
    KvGeometry geo;
    geo.head_dim = 128;
    geo.num_qo_heads = 32;
    geo.num_kv_heads = 4;
    geo.page_size = round % 2 ? 16 : 1;
    geo.dtype = KvDType::kBf16;
    geo.num_layers = 1;
    geo.num_pages = 40000 / geo.page_size;
    HostBatch pools;
    pools.geo = geo;
    gpu_test::MakePools(&pools, &rng);
    auto made = MakeCudaBackend(Options(geo));
    ASSERT_TRUE(made.ok()) << made.status();
    std::unique_ptr<Backend> backend = std::move(made).value();
    ASSERT_EQ(backend->PipelineDepth(), 2);
    ASSERT_TRUE(UploadPools(*backend, pools, nullptr).ok());

    // A: one long sequence (split and merged on some rounds) and a short one.
    HostBatch a, b;
    a.geo = b.geo = geo;
    gpu_test::AddSeq(&a, 1 + rng() % 64, 20000 + rng() % 10000, 0, true, false,
                     1 / std::sqrt(128.f), &rng);
    gpu_test::AddSeq(&a, 1 + rng() % 300, 1000 + rng() % 2000, 0, rng() % 2, false,
                     1 / std::sqrt(128.f), &rng);
    gpu_test::FinishBatch(&a, 1.f, &rng);
    // B reads the same pages as A's first sequence and appends over some of
    // its slots.
    b.seqs.push_back(a.seqs[0]);
    b.seqs[0].q_start = 0;
    b.seqs[0].kv_start = 0;
    b.kv_indices.assign(a.kv_indices.begin(), a.kv_indices.begin() + (a.seqs[0].kv_len + geo.page_size - 1) / geo.page_size);
    b.total_q = b.seqs[0].q_len;
    gpu_test::FinishBatch(&b, 1.f, &rng);
    std::vector<int64_t> app_slots;
    for (int i = 0; i < 500; ++i) {
      const int64_t pos = rng() % a.seqs[0].kv_len;
      app_slots.push_back(int64_t{b.kv_indices[pos / geo.page_size]} * geo.page_size + pos % geo.page_size);
    }
    const int64_t re = geo.RowElems();
    std::vector<uint16_t> app_k(app_slots.size() * re), app_v(app_slots.size() * re);
    gpu_test::FillRandom(&app_k, geo.dtype, 1.f, &rng);
    gpu_test::FillRandom(&app_v, geo.dtype, 1.f, &rng);

    auto make_task = [&](HostBatch& h, std::vector<uint16_t>* o, std::vector<float>* lse) {
      PrefillTask t;
      t.q = h.q.data();
      t.total_q = h.total_q;
      t.seqs = h.seqs;
      t.kv_indices = h.kv_indices.data();
      t.num_kv_indices = static_cast<int32_t>(h.kv_indices.size());
      o->assign(size_t(h.total_q) * geo.num_qo_heads * geo.head_dim, 0xFFFF);  // poison
      lse->assign(size_t(h.total_q) * geo.num_qo_heads, NAN);
      t.o = o->data();
      t.lse = lse->data();
      return t;
    };
    std::vector<uint16_t> o_a, o_b;
    std::vector<float> lse_a, lse_b;
    PrefillTask ta = make_task(a, &o_a, &lse_a);
    PrefillTask tb = make_task(b, &o_b, &lse_b);
    tb.append_slots = app_slots.data();
    tb.num_append = static_cast<int64_t>(app_slots.size());
    tb.append_k = app_k.data();
    tb.append_v = app_v.data();

    BatchStats sa, sb;
    ASSERT_TRUE(backend->Submit({ta}, &sa).ok());
    ASSERT_TRUE(backend->Submit({tb}, &sb).ok());
    BatchStats sc;
    EXPECT_EQ(backend->Submit({ta}, &sc).code(), absl::StatusCode::kFailedPrecondition);
    std::vector<uint16_t> rk(re), rv(re);
    KvRows rd;
    rd.slots = app_slots.data();
    rd.n = 1;
    rd.k = rk.data();
    rd.v = rv.data();
    EXPECT_EQ(backend->ReadKv(rd, nullptr).code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(backend->Complete(&sa).ok());
    ASSERT_TRUE(backend->Complete(&sb).ok());
    EXPECT_EQ(sa.attention_launches, ExpectedLaunches({&ta.seqs}).first);
    EXPECT_EQ(sb.append_launches, 1);
    EXPECT_EQ(backend->Complete(&sc).code(), absl::StatusCode::kFailedPrecondition);

    a.k_pool = pools.k_pool;
    a.v_pool = pools.v_pool;
    std::vector<double> o_ref, lse_ref;
    gpu_test::Reference(a, &o_ref, &lse_ref);
    EXPECT_EQ(gpu_test::Compare(geo.dtype, o_a, lse_a, o_ref, lse_ref), "") << "round " << round << " batch A";
    b.k_pool = std::move(pools.k_pool);
    b.v_pool = std::move(pools.v_pool);
    for (size_t i = 0; i < app_slots.size(); ++i) {
      std::memcpy(&b.k_pool[app_slots[i] * re], &app_k[i * re], re * 2);
      std::memcpy(&b.v_pool[app_slots[i] * re], &app_v[i * re], re * 2);
    }
    gpu_test::Reference(b, &o_ref, &lse_ref);
    EXPECT_EQ(gpu_test::Compare(geo.dtype, o_b, lse_b, o_ref, lse_ref), "") << "round " << round << " batch B";
  }
}

}  // namespace
}  // namespace attnserve
