// The CUDA backend's batch packer (host code, no GPU): how it routes a
// batch's sequences between the decode and prefill kernel families, and that
// the staging holds exactly the plans it reports.
#include "server/backend/cuda/batch_packer.h"

#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/plan/decode_plan.h"
#include "kernels/plan/mla_plan.h"
#include "kernels/plan/prefill_plan.h"
#include "server/backend/cuda/staging_packer.h"
#include "tests/core/scatter_test_util.h"

namespace attnserve {
namespace {

KvGeometry Geo(int32_t qo, int32_t kv, int32_t d, int32_t ps) {
  KvGeometry g;
  g.num_layers = 2;
  g.num_qo_heads = qo;
  g.num_kv_heads = kv;
  g.head_dim = d;
  g.page_size = ps;
  g.num_pages = 4096;
  return g;
}

PackerLimits Limits(bool decode) {
  PackerLimits lim;
  lim.max_rows = 8192;
  lim.max_indices = 1 << 20;
  lim.max_append = 1024;
  lim.max_partial_pairs = 1 << 16;
  lim.max_items = 1 << 16;
  lim.max_decode_items = 1 << 16;
  lim.num_sms = 132;
  lim.device = PrefillDevice{9, 0};
  lim.decode = decode;
  lim.decode_ctas_per_sm[0] = lim.decode_ctas_per_sm[1] = 2;
  return lim;
}

// One request: sequences of (q_len, kv_len), page ids 0, 1, ... per sequence.
struct Request {
  std::vector<uint16_t> q;
  std::vector<int32_t> idx;
  PrefillTask task;
};

void MakeRequest(const KvGeometry& g, const std::vector<std::pair<int, int>>& shapes, int layer, Request* r) {
  int32_t rows = 0, pages = 0;
  for (auto [q_len, kv_len] : shapes) {
    PrefillSeq s;
    s.q_start = rows;
    s.q_len = q_len;
    s.kv_start = pages;
    s.kv_len = kv_len;
    s.layer = layer;
    s.causal = 1;
    s.sm_scale = 0.1f;
    r->task.seqs.push_back(s);
    rows += q_len;
    const int32_t n = (kv_len + g.page_size - 1) / g.page_size;
    for (int32_t i = 0; i < n; ++i) r->idx.push_back(i % g.num_pages);
    pages += n;
  }
  r->q.assign(size_t(rows) * g.num_qo_heads * g.head_dim, 1);
  r->task.layer = layer;
  r->task.q = r->q.data();
  r->task.total_q = rows;
  r->task.kv_indices = r->idx.data();
  r->task.num_kv_indices = static_cast<int32_t>(r->idx.size());
}

struct Packed {
  PackedBatch b;
  std::unique_ptr<uint8_t[]> staging;  // uninitialized: Pack writes what it reports
  std::vector<PrefillSeq> seqs;
  std::vector<DecodeWorkItem> decode_items;
  std::vector<PrefillWorkItem> prefill_items;
};

Packed Pack(const KvGeometry& g, const PackerLimits& lim, std::vector<Request>& reqs) {
  Packed p;
  BatchPacker packer(g, lim);
  const int64_t capacity = packer.InputCapacity();
  p.staging.reset(new uint8_t[capacity]);
  std::vector<PrefillTask> tasks;
  for (Request& r : reqs) tasks.push_back(r.task);
  const absl::Status st = packer.Pack(tasks, p.staging.get(), capacity, &p.b);
  EXPECT_TRUE(st.ok()) << st;
  p.seqs.resize(p.b.num_seqs);
  if (!p.seqs.empty()) {
    std::memcpy(p.seqs.data(), p.staging.get() + p.b.off_seqs, p.seqs.size() * sizeof(PrefillSeq));
  }
  p.decode_items.resize(p.b.num_decode_items);
  if (!p.decode_items.empty()) {
    std::memcpy(p.decode_items.data(), p.staging.get() + p.b.off_decode_items,
                p.decode_items.size() * sizeof(DecodeWorkItem));
  }
  p.prefill_items.resize(p.b.num_items);
  if (!p.prefill_items.empty()) {
    std::memcpy(p.prefill_items.data(), p.staging.get() + p.b.off_items,
                p.prefill_items.size() * sizeof(PrefillWorkItem));
  }
  return p;
}

// Which family covers each batch sequence, from the packed work items.
void Coverage(const Packed& p, std::vector<int>* by_decode, std::vector<int>* by_prefill) {
  by_decode->assign(p.seqs.size(), 0);
  by_prefill->assign(p.seqs.size(), 0);
  for (const DecodeWorkItem& it : p.decode_items) (*by_decode)[it.seq]++;
  for (const PrefillWorkItem& it : p.prefill_items) {
    if (it.seq == -1) {
      // Padding of a persistent kernel's layout (PrefillPlanOptions::persistent_ctas).
      EXPECT_GT(PrefillPersistentCtas(p.b.kernel, 132, 1), 0) << "padding for " << PrefillKernelName(p.b.kernel);
      continue;
    }
    ASSERT_GE(it.seq, 0);
    ASSERT_LT(it.seq, static_cast<int32_t>(p.seqs.size()));
    (*by_prefill)[it.seq]++;
  }
}

TEST(BatchPacker, DecodeBatchRunsOnlyTheDecodeFamily) {
  const KvGeometry g = Geo(32, 4, 128, 16);
  std::vector<Request> reqs(3);
  MakeRequest(g, {{1, 4096}, {1, 100}}, 0, &reqs[0]);
  MakeRequest(g, {{8, 300}}, 1, &reqs[1]);          // speculative, 8 rows
  MakeRequest(g, {{4, 1}, {1, 2000}}, 0, &reqs[2]);
  const Packed p = Pack(g, Limits(true), reqs);
  EXPECT_EQ(p.b.num_seqs, 5);
  EXPECT_EQ(p.b.num_decode_seqs, 5);
  EXPECT_EQ(p.b.num_items, 0);
  EXPECT_EQ(p.b.num_merges, 0);
  EXPECT_GT(p.b.num_decode_items, 0);
  EXPECT_EQ(p.b.decode_tile_rows, 32);  // 8 rows x group 8 = 64 packed rows: 2 tiles of 32
  std::vector<int> dec, pre;
  Coverage(p, &dec, &pre);
  for (size_t i = 0; i < p.seqs.size(); ++i) {
    EXPECT_GE(dec[i], g.num_kv_heads) << "seq " << i;
    EXPECT_EQ(pre[i], 0) << "seq " << i;
  }
  // The staged sequences keep their real q_len (the decode kernel reads them)
  // and batch-global offsets.
  EXPECT_EQ(p.seqs[2].q_len, 8);
  EXPECT_EQ(p.seqs[2].q_start, 2);
  EXPECT_EQ(p.seqs[2].layer, 1);
  EXPECT_EQ(p.seqs[3].q_start, 10);
}

TEST(BatchPacker, MixedBatchRoutesEachSequenceToOneFamily) {
  const KvGeometry g = Geo(16, 2, 64, 1);
  std::vector<Request> reqs(2);
  MakeRequest(g, {{1, 700}, {9, 900}, {8, 50}}, 0, &reqs[0]);
  MakeRequest(g, {{300, 300}, {2, 5000}, {0, 10}}, 1, &reqs[1]);
  const Packed p = Pack(g, Limits(true), reqs);
  ASSERT_EQ(p.b.num_seqs, 5);  // q_len 0 dropped
  EXPECT_EQ(p.b.num_decode_seqs, 3);
  EXPECT_GT(p.b.num_items, 0);
  EXPECT_GT(p.b.num_decode_items, 0);
  std::vector<int> dec, pre;
  Coverage(p, &dec, &pre);
  for (size_t i = 0; i < p.seqs.size(); ++i) {
    const bool decode = p.seqs[i].q_len <= kMaxDecodeQueryRows;
    EXPECT_EQ(dec[i] > 0, decode) << "seq " << i << " q_len " << p.seqs[i].q_len;
    EXPECT_EQ(pre[i] > 0, !decode) << "seq " << i << " q_len " << p.seqs[i].q_len;
  }
  // 1 x 5000 of 2 KV heads is worth a split on 132 SMs.
  EXPECT_GT(p.b.decode_split_tiles, 0);
}

// Inputs in device memory (CUDA regions) are never read by the packer (the
// pointers below would fault): they become device-to-device copies into the
// staging, consecutive rows coalesced, and the upload skips their bytes.
TEST(BatchPacker, DeviceInputsBecomeCopiesAndAreNotUploaded) {
  const KvGeometry g = Geo(8, 2, 64, 16);
  const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim * 2, kv_row = g.RowElems() * 2;
  const auto* dev_q = reinterpret_cast<const uint8_t*>(uintptr_t{0xdead0000});
  const auto* dev_k = reinterpret_cast<const uint8_t*>(uintptr_t{0xbeef0000});
  const auto* dev_v = reinterpret_cast<const uint8_t*>(uintptr_t{0xfeed0000});
  std::vector<Request> reqs(2);
  MakeRequest(g, {{1, 40}, {5, 70}}, 0, &reqs[0]);
  MakeRequest(g, {{3, 30}}, 1, &reqs[1]);
  reqs[0].task.q = dev_q;
  reqs[0].task.q_on_device = true;
  const std::vector<int64_t> slots0 = {5, 6, 7}, slots1 = {9};
  reqs[0].task.append_slots = slots0.data();
  reqs[0].task.num_append = 3;
  reqs[0].task.append_k = dev_k;
  reqs[0].task.append_v = dev_v;
  reqs[0].task.append_k_on_device = reqs[0].task.append_v_on_device = true;
  std::vector<uint16_t> host_kv(g.RowElems(), 7);
  reqs[1].task.append_slots = slots1.data();
  reqs[1].task.num_append = 1;
  reqs[1].task.append_k = reqs[1].task.append_v = host_kv.data();
  Packed p = Pack(g, Limits(true), reqs);
  using Copy = PackedBatch::DeviceCopy;
  ASSERT_EQ(p.b.device_in.size(), 3u);
  auto expect_copy = [](const Copy& c, int64_t dst, const void* src, int64_t bytes) {
    EXPECT_EQ(c.dst, dst);
    EXPECT_EQ(c.src, src);
    EXPECT_EQ(c.bytes, bytes);
  };
  expect_copy(p.b.device_in[0], p.b.off_q, dev_q, 6 * q_row);
  expect_copy(p.b.device_in[1], p.b.off_k, dev_k, 3 * kv_row);  // three rows, one copy
  expect_copy(p.b.device_in[2], p.b.off_v, dev_v, 3 * kv_row);
  // The host request's q and appended row are packed behind them.
  EXPECT_EQ(std::memcmp(p.staging.get() + p.b.off_q + 6 * q_row, reqs[1].q.data(), 3 * q_row), 0);
  EXPECT_EQ(std::memcmp(p.staging.get() + p.b.off_k + 3 * kv_row, host_kv.data(), kv_row), 0);
  EXPECT_EQ(p.b.upload_begin, 0);  // host q and host rows: everything goes up
  EXPECT_EQ(p.b.upload_end, p.b.in_bytes);

  // Every input on the device: only the layout between q and the K/V rows is uploaded.
  reqs[1].task.q = dev_q + 6 * q_row;  // continues the first request's q
  reqs[1].task.q_on_device = true;
  reqs[1].task.append_k = dev_k + 3 * kv_row;
  reqs[1].task.append_v = dev_v + 3 * kv_row;
  reqs[1].task.append_k_on_device = reqs[1].task.append_v_on_device = true;
  p = Pack(g, Limits(true), reqs);
  ASSERT_EQ(p.b.device_in.size(), 3u);
  expect_copy(p.b.device_in[0], p.b.off_q, dev_q, 9 * q_row);
  expect_copy(p.b.device_in[1], p.b.off_k, dev_k, 4 * kv_row);
  expect_copy(p.b.device_in[2], p.b.off_v, dev_v, 4 * kv_row);
  EXPECT_EQ(p.b.upload_begin, p.b.off_idx);
  EXPECT_EQ(p.b.upload_end, p.b.off_k);
  EXPECT_GT(p.b.upload_end, p.b.upload_begin);
}

// Inputs in page-locked host memory (registered system regions): from 64 KiB
// up they are copied by the device straight from the region, like device
// inputs; smaller ones are packed into the staging with the rest.
TEST(BatchPacker, LargePinnedInputsBecomeCopiesSmallOnesArePacked) {
  const KvGeometry g = Geo(32, 4, 128, 16);
  const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim * 2;  // 8 KiB
  std::vector<Request> reqs(2);
  MakeRequest(g, {{8, 100}, {8, 300}}, 0, &reqs[0]);  // 16 rows: 128 KiB
  MakeRequest(g, {{4, 50}}, 1, &reqs[1]);              // 4 rows: 32 KiB
  reqs[0].task.q_pinned = true;
  reqs[1].task.q_pinned = true;
  const Packed p = Pack(g, Limits(true), reqs);
  ASSERT_EQ(p.b.device_in.size(), 1u);
  EXPECT_EQ(p.b.device_in[0].dst, p.b.off_q);
  EXPECT_EQ(p.b.device_in[0].src, reqs[0].q.data());
  EXPECT_EQ(p.b.device_in[0].bytes, 16 * q_row);
  // The small one sits behind it in the staging, and the upload covers it.
  EXPECT_EQ(std::memcmp(p.staging.get() + p.b.off_q + 16 * q_row, reqs[1].q.data(), 4 * q_row), 0);
  EXPECT_EQ(p.b.upload_begin, 0);

  // Both large: the q bytes are not uploaded from the staging at all.
  std::vector<Request> large(1);
  MakeRequest(g, {{8, 100}, {8, 300}}, 0, &large[0]);
  large[0].task.q_pinned = true;
  const Packed q = Pack(g, Limits(true), large);
  ASSERT_EQ(q.b.device_in.size(), 1u);
  EXPECT_EQ(q.b.upload_begin, q.b.off_idx);
}

// Inline inputs in pieces are gathered into the staging: the packed bytes
// are those of the same inputs given contiguously, with the appends' last
// writes kept, checked against the rows computed here.
TEST(BatchPacker, ScatteredInputsAreGatheredIntoTheStaging) {
  const KvGeometry g = Geo(8, 2, 64, 16);
  const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim * 2, kv_row = g.RowElems() * 2;
  std::mt19937 rng(21);
  auto random_halves = [&rng](size_t n) {
    std::vector<uint16_t> out(n);
    for (uint16_t& h : out) h = static_cast<uint16_t>(rng());
    return out;
  };
  std::vector<Request> reqs(3);
  MakeRequest(g, {{1, 40}, {50, 70}}, 0, &reqs[0]);
  MakeRequest(g, {{3, 30}}, 0, &reqs[1]);
  MakeRequest(g, {{2, 20}}, 1, &reqs[2]);
  for (Request& r : reqs) {
    r.q = random_halves(r.q.size());
    r.task.q = r.q.data();
  }
  // Request 1 writes slot 7 of layer 0 again (the later write wins: request
  // 0's rows 0-1 and 3-4 stay, in two runs); request 2 writes slot 5 of
  // layer 1 (not the same row as layer 0's slot 5).
  const std::vector<int64_t> slots[3] = {{5, 6, 7, 8, 9}, {7, 20}, {5}};
  std::vector<uint16_t> k[3], v[3];
  for (int i = 0; i < 3; ++i) {
    const size_t n = slots[i].size();
    k[i] = random_halves(n * g.RowElems());
    v[i] = random_halves(n * g.RowElems());
    reqs[i].task.append_slots = slots[i].data();
    reqs[i].task.num_append = static_cast<int64_t>(n);
    reqs[i].task.append_k = k[i].data();
    reqs[i].task.append_v = v[i].data();
  }
  // The rows the staging must hold, in order of each (layer, slot)'s first
  // write, with its last write's bytes: (request, row).
  const std::pair<int, int> kept[] = {{0, 0}, {0, 1}, {1, 0}, {0, 3}, {0, 4}, {1, 1}, {2, 0}};
  auto expect_packed = [&](const Packed& p) {
    ASSERT_EQ(p.b.num_append, 7);
    const uint8_t* at = p.staging.get() + p.b.off_q;
    for (const Request& r : reqs) {
      EXPECT_EQ(std::memcmp(at, r.q.data(), r.q.size() * 2), 0);
      at += r.q.size() * 2;
    }
    for (int i = 0; i < 7; ++i) {
      const auto [req, row] = kept[i];
      const auto* k_row = reinterpret_cast<const uint8_t*>(k[req].data()) + row * kv_row;
      const auto* v_row = reinterpret_cast<const uint8_t*>(v[req].data()) + row * kv_row;
      EXPECT_EQ(std::memcmp(p.staging.get() + p.b.off_k + i * kv_row, k_row, kv_row), 0)
          << "K row " << i;
      EXPECT_EQ(std::memcmp(p.staging.get() + p.b.off_v + i * kv_row, v_row, kv_row), 0)
          << "V row " << i;
    }
    EXPECT_TRUE(p.b.device_in.empty());
    EXPECT_EQ(p.b.upload_begin, 0);
    EXPECT_EQ(p.b.upload_end, p.b.in_bytes);
  };
  {
    SCOPED_TRACE("contiguous");
    expect_packed(Pack(g, Limits(true), reqs));
  }
  // Requests 0 and 1 in pieces (request 2 stays contiguous): pieces smaller
  // than a row, about a row, and larger than the whole tensor.
  for (size_t max_piece : {size_t{13}, size_t{300}, size_t{1} << 20}) {
    SCOPED_TRACE(max_piece);
    std::deque<Pieces> held;
    for (int i = 0; i < 2; ++i) {
      PrefillTask& t = reqs[i].task;
      held.emplace_back(reqs[i].q.data(), t.total_q * q_row, max_piece, 3 * i + 1);
      t.q_scattered = held.back().list;
      held.emplace_back(k[i].data(), t.num_append * kv_row, max_piece, 3 * i + 2);
      t.append_k_scattered = held.back().list;
      held.emplace_back(v[i].data(), t.num_append * kv_row, max_piece, 3 * i + 3);
      t.append_v_scattered = held.back().list;
      t.q = t.append_k = t.append_v = nullptr;  // as the core hands pieces over
    }
    expect_packed(Pack(g, Limits(true), reqs));
  }
}

// Each task's sink set lands once in the staging; its sequences point at it
// (their sink_index rebased), the others at none; a batch with a soft-cap
// asks for the kernels that have it.
TEST(BatchPacker, SinkSetsArePackedOncePerTaskAndSequencesRebased) {
  const KvGeometry g = Geo(8, 2, 128, 16);
  std::vector<Request> reqs(4);
  MakeRequest(g, {{1, 100}, {3, 300}}, 0, &reqs[0]);  // sinks
  MakeRequest(g, {{2, 50}}, 1, &reqs[1]);             // none
  MakeRequest(g, {{1, 70}, {0, 10}, {5, 900}}, 0, &reqs[2]);  // sinks; one sequence without
  MakeRequest(g, {{4, 40}}, 1, &reqs[3]);             // soft-capped, no sinks
  std::vector<float> sinks0(8), sinks2(8);
  for (int h = 0; h < 8; ++h) {
    sinks0[h] = 0.5f + h;
    sinks2[h] = -2.25f - h;
  }
  reqs[0].task.sinks = sinks0.data();
  for (PrefillSeq& s : reqs[0].task.seqs) s.sink_index = 0;
  reqs[2].task.sinks = sinks2.data();
  reqs[2].task.seqs[0].sink_index = 0;
  reqs[2].task.seqs[2].sink_index = -1;
  reqs[3].task.seqs[0].soft_cap = 30.f;

  Packed p = Pack(g, Limits(true), reqs);
  ASSERT_EQ(p.b.num_sink_sets, 2);
  EXPECT_TRUE(p.b.any_soft_cap);
  std::vector<float> packed(16);
  std::memcpy(packed.data(), p.staging.get() + p.b.off_sinks, 16 * sizeof(float));
  for (int h = 0; h < 8; ++h) {
    EXPECT_EQ(packed[h], sinks0[h]);
    EXPECT_EQ(packed[8 + h], sinks2[h]);
  }
  // Batch sequences (q_len 0 dropped): r0's two, r1's one, r2's two, r3's one.
  ASSERT_EQ(p.seqs.size(), 6u);
  const int32_t want[6] = {0, 0, -1, 1, -1, -1};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(p.seqs[i].sink_index, want[i]) << "batch sequence " << i;
  EXPECT_EQ(p.seqs[5].soft_cap, 30.f);
  EXPECT_GE(p.b.off_sinks, p.b.upload_begin);
  EXPECT_LE(p.b.off_sinks + 16 * int64_t{sizeof(float)}, p.b.upload_end);

  // Without sinks or soft-caps: no sets, the lean kernels.
  std::vector<Request> plain(1);
  MakeRequest(g, {{3, 200}}, 0, &plain[0]);
  Packed q = Pack(g, Limits(true), plain);
  EXPECT_EQ(q.b.num_sink_sets, 0);
  EXPECT_FALSE(q.b.any_soft_cap);
}

TEST(BatchPacker, DecodeOffRoutesEverythingToPrefill) {
  const KvGeometry g = Geo(32, 4, 128, 16);
  std::vector<Request> reqs(1);
  MakeRequest(g, {{1, 4096}, {3, 100}, {64, 64}}, 0, &reqs[0]);
  const Packed p = Pack(g, Limits(false), reqs);
  EXPECT_EQ(p.b.num_decode_seqs, 0);
  EXPECT_EQ(p.b.num_decode_items, 0);
  std::vector<int> dec, pre;
  Coverage(p, &dec, &pre);
  for (size_t i = 0; i < p.seqs.size(); ++i) EXPECT_GT(pre[i], 0) << "seq " << i;
}

// FP8 pools route as 16-bit pools do, on every device and head_dim: decode
// rows to the decode family when it is on, the rest to the prefill kernel
// ChoosePrefillKernel picks for the family asked for (the sm80 family and
// kSm90Overlap read FP8 pools), with the same items; but auto on Hopper
// at head_dim 64 and 128 runs kSm90Overlap whatever the lengths.
TEST(BatchPacker, Fp8PoolsRouteAsSixteenBitPools) {
  int sm80 = 0, sm90 = 0;
  for (const int d : {128, 64, 256}) {
    for (const PrefillDevice dev : {PrefillDevice{8, 9}, PrefillDevice{9, 0}}) {
      for (const PrefillFamily fam : {PrefillFamily::kAuto, PrefillFamily::kSm80, PrefillFamily::kSm90}) {
        if (!PrefillFamilyRunsOn(fam, dev)) continue;
        for (const bool decode : {true, false}) {
          const KvGeometry g16 = Geo(16, 2, d, 16);
          KvGeometry g8 = g16;
          g8.kv_fp8 = d == 64 ? Fp8Format::kE5m2 : Fp8Format::kE4m3;
          PackerLimits lim = Limits(decode);
          lim.device = dev;
          lim.family = fam;
          const std::vector<std::pair<int, int>> shapes = {{1, 700}, {300, 900}, {8, 50}, {40, 40}};
          std::vector<Request> r16(1), r8(1);
          MakeRequest(g16, shapes, 0, &r16[0]);
          MakeRequest(g8, shapes, 0, &r8[0]);
          const Packed p16 = Pack(g16, lim, r16);
          const Packed p8 = Pack(g8, lim, r8);
          const std::string at = std::to_string(d) + " " + PrefillFamilyName(fam) + " sm" +
                                 std::to_string(dev.sm_major) + std::to_string(dev.sm_minor) + " decode " +
                                 std::to_string(decode);
          if (fam == PrefillFamily::kAuto && dev.sm_major == 9 && d != 256) {
            EXPECT_EQ(p8.b.kernel, PrefillKernel::kSm90Overlap) << at;
            continue;
          }
          EXPECT_EQ(p8.b.kernel, p16.b.kernel) << at;
          EXPECT_EQ(p8.b.num_items, p16.b.num_items) << at;
          EXPECT_EQ(p8.b.num_decode_items, p16.b.num_decode_items) << at;
          std::vector<int> dec8, pre8, dec16, pre16;
          Coverage(p8, &dec8, &pre8);
          Coverage(p16, &dec16, &pre16);
          EXPECT_EQ(dec8, dec16) << at;
          EXPECT_EQ(pre8, pre16) << at;
          for (int i : {1, 3}) EXPECT_GT(pre8[i], 0) << at << " seq " << i;
          for (int i : {0, 2}) EXPECT_EQ(decode ? dec8[i] > 0 : pre8[i] > 0, true) << at << " seq " << i;
          sm90 += p8.b.kernel == PrefillKernel::kSm90Overlap;
          sm80 += p8.b.kernel == PrefillKernel::kSm80 || p8.b.kernel == PrefillKernel::kSm80Rows64;
        }
      }
    }
  }
  EXPECT_GT(sm80, 0);
  EXPECT_GT(sm90, 0);
}

TEST(BatchPacker, UnsupportedGeometryFallsBackToPrefill) {
  KvGeometry g = Geo(8, 2, 96, 16);  // head_dim 96: no decode kernel
  std::vector<Request> reqs(1);
  MakeRequest(g, {{1, 500}}, 0, &reqs[0]);
  const Packed p = Pack(g, Limits(true), reqs);
  EXPECT_EQ(p.b.num_decode_items, 0);
  EXPECT_GT(p.b.num_items, 0);
}

// An MLA geometry: every sequence runs on the MLA family, whose items and
// merges are the staging's; appended rows are K's alone (no V pool); the
// outputs are kv_lora_rank wide.
TEST(BatchPacker, MlaBatchesRunTheMlaFamilyAndAppendKAlone) {
  KvGeometry g = Geo(16, 1, kMlaKvLoraRank + kMlaRopeDim, 64);
  g.attention = AttentionKind::kMla;
  g.kv_lora_rank = kMlaKvLoraRank;
  g.qk_rope_head_dim = kMlaRopeDim;
  PackerLimits lim = Limits(true);
  lim.mla.num_sms = 132;
  lim.max_items = MlaMaxItems(lim.mla, lim.max_rows, g.num_qo_heads);
  lim.max_partial_pairs = MlaMaxPartialSlots(lim.mla) * lim.mla.tile_rows;
  for (const bool long_batch : {false, true}) {
    std::vector<Request> reqs(2);
    if (long_batch) {  // few tiles: they split and merge
      MakeRequest(g, {{1, 4000}, {2, 3000}}, 0, &reqs[0]);
      MakeRequest(g, {{1, 5000}}, 1, &reqs[1]);
    } else {  // many tiles: no split
      std::vector<std::pair<int, int>> shapes;
      for (int i = 0; i < 200; ++i) shapes.push_back({1 + i % 3, 50 + i});
      MakeRequest(g, shapes, 0, &reqs[0]);
      MakeRequest(g, {{40, 40}}, 1, &reqs[1]);
    }
    const int64_t kv_row = g.RowElems() * 2;
    std::vector<int64_t> slots = {3, 9, 700};
    std::vector<uint16_t> k(3 * g.RowElems());
    for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint16_t>(i * 7 + 1);
    reqs[1].task.append_slots = slots.data();
    reqs[1].task.num_append = 3;
    reqs[1].task.append_k = k.data();
    const Packed p = Pack(g, lim, reqs);
    EXPECT_TRUE(p.b.mla);
    EXPECT_EQ(p.b.mla_tile_rows, lim.mla.tile_rows);
    EXPECT_EQ(p.b.num_decode_items, 0);
    // The staging's items and merges are the MLA plan of the batch.
    MlaPlan want;
    BuildMlaPlan(p.seqs.data(), p.b.num_seqs, g, lim.mla, &want);
    ASSERT_EQ(p.b.num_items, static_cast<int32_t>(want.items.size()));
    ASSERT_EQ(p.b.num_merges, static_cast<int32_t>(want.merges.size()));
    EXPECT_EQ(p.b.num_merges > 0, long_batch);
    EXPECT_EQ(std::memcmp(p.staging.get() + p.b.off_items, want.items.data(),
                          want.items.size() * sizeof(MlaWorkItem)),
              0);
    if (!want.merges.empty()) {
      EXPECT_EQ(std::memcmp(p.staging.get() + p.b.off_merges, want.merges.data(),
                            want.merges.size() * sizeof(MlaMergeTile)),
                0);
    }
    EXPECT_LE(int64_t{want.partial_slots} * want.tile_rows, lim.max_partial_pairs);
    // K rows appended, no V section.
    EXPECT_EQ(p.b.num_append, 3);
    EXPECT_EQ(std::memcmp(p.staging.get() + p.b.off_k, k.data(), 3 * kv_row), 0);
    EXPECT_EQ(p.b.off_v, AlignUp(p.b.off_k + 3 * kv_row));
    EXPECT_EQ(p.b.off_k8, p.b.off_v);
    std::vector<int64_t> global(3);  // layer-global slots
    std::memcpy(global.data(), p.staging.get() + p.b.off_slots, 3 * 8);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(global[i], g.SlotsPerLayer() + slots[i]);
    // Outputs: kv_lora_rank wide.
    EXPECT_EQ(p.b.off_lse, AlignUp(p.b.total_q * g.num_qo_heads * kMlaKvLoraRank * 2));
    EXPECT_EQ(p.b.out_bytes, p.b.off_lse + p.b.total_q * g.num_qo_heads * 4);
  }
  BatchPacker packer(g, lim);
  EXPECT_EQ(packer.OutputCapacity(), AlignUp(lim.max_rows * g.num_qo_heads * kMlaKvLoraRank * 2) +
                                         AlignUp(lim.max_rows * g.num_qo_heads * 4) + kStagingAlign);
}

// Random mixed batches: every sequence is covered by exactly the family its
// q_len selects, and the decode items fit the workspace the limits give.
TEST(BatchPacker, RandomMixedBatches) {
  std::mt19937 rng(14);
  for (int it = 0; it < 120; ++it) {
    const int ps = (int[]){1, 16, 64}[rng() % 3];
    const int d = (int[]){64, 128, 256}[rng() % 3];
    const int kvh = 1 + rng() % 4;
    const KvGeometry g = Geo(kvh * (1 << (rng() % 4)), kvh, d, ps);
    std::vector<Request> reqs(1 + rng() % 4);
    for (Request& r : reqs) {
      std::vector<std::pair<int, int>> shapes;
      const int n = 1 + rng() % 5;
      for (int s = 0; s < n; ++s) {
        const int q_len = rng() % 3 == 0 ? 1 + rng() % 200 : rng() % 9;
        shapes.push_back({q_len, static_cast<int>(rng() % 6000)});
      }
      MakeRequest(g, shapes, rng() % 2, &r);
    }
    const bool decode = rng() % 4 != 0;
    const PackerLimits lim = Limits(decode);
    const Packed p = Pack(g, lim, reqs);
    std::vector<int> dec, pre;
    Coverage(p, &dec, &pre);
    int decode_seqs = 0;
    for (size_t i = 0; i < p.seqs.size(); ++i) {
      ASSERT_GT(p.seqs[i].q_len, 0);
      const bool want_decode = decode && p.seqs[i].q_len <= kMaxDecodeQueryRows;
      decode_seqs += want_decode;
      EXPECT_EQ(dec[i] > 0, want_decode) << "batch " << it << " seq " << i;
      EXPECT_EQ(pre[i] > 0, !want_decode) << "batch " << it << " seq " << i;
    }
    EXPECT_EQ(p.b.num_decode_seqs, decode_seqs);
    int64_t slots = 0;
    for (const DecodeWorkItem& di : p.decode_items) {
      if (di.split_tile >= 0) slots = std::max<int64_t>(slots, di.part_begin + di.num_chunks);
    }
    EXPECT_LE(slots, DecodePartialSlots(lim, d));
    EXPECT_LE(p.b.decode_split_tiles, DecodePartialSlots(lim, d));
  }
}

}  // namespace
}  // namespace attnserve
