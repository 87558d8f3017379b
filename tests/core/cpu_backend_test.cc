// The CPU backend with inline inputs that arrived in pieces (ScatterList) or
// at odd addresses, as the edge hands them over, flattened a chunk at a time:
// every result is bit for bit what the same inputs give as aligned
// contiguous arrays. And a task whose caller may give up: run in groups of
// bounded work, the same bits, and nothing computed once it has given up.
#include "server/backend/cpu/cpu_backend.h"

#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/core/scatter_test_util.h"

namespace attnserve {
namespace {

KvGeometry Geo() {
  KvGeometry g;
  g.num_layers = 2;
  g.num_pages = 8;
  g.page_size = 4;
  g.num_qo_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.dtype = KvDType::kBf16;
  return g;
}

// n bf16 values, uniform in [-2, 2].
std::vector<uint16_t> RandomBf16(std::mt19937* rng, int64_t n) {
  std::uniform_real_distribution<float> dist(-2.f, 2.f);
  std::vector<uint16_t> out(static_cast<size_t>(n));
  for (uint16_t& h : out) {
    const float f = dist(*rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    h = static_cast<uint16_t>(u >> 16);
  }
  return out;
}

// `values`' bytes as pieces of 1 to 97 bytes.
struct ValuePieces : Pieces {
  ValuePieces(const std::vector<uint16_t>& values, uint32_t seed)
      : Pieces(values.data(), static_cast<int64_t>(values.size()) * 2, 97, seed) {}
};

// `values` at an odd address (the returned string keeps it).
std::string Misaligned(const std::vector<uint16_t>& values) {
  return std::string(1, 'x') +
         std::string(reinterpret_cast<const char*>(values.data()), values.size() * 2);
}

// Inputs larger than the backend's flattening chunk (1 MiB): WriteKV and
// the fused append cycle over a few slots (the last write of each must win
// across chunks), and the long sequence's causal diagonal lies in its second
// chunk of rows.
TEST(CpuBackendTest, ScatteredAndMisalignedInputsGiveTheContiguousResults) {
  const KvGeometry g = Geo();
  std::mt19937 rng(3);
  const int64_t row_elems = g.RowElems();  // 256 bytes a row: 4096 rows a chunk
  // WriteKV: 5000 rows over slots 0..15 of layer 1.
  const int64_t n = 5000;
  std::vector<int64_t> slots(n);
  for (int64_t i = 0; i < n; ++i) slots[i] = i % 16;
  const std::vector<uint16_t> k = RandomBf16(&rng, n * row_elems);
  const std::vector<uint16_t> v = RandomBf16(&rng, n * row_elems);
  // The fused append: 4100 rows over slots 16..23.
  const int64_t n_append = 4100;
  std::vector<int64_t> append_slots(n_append);
  for (int64_t i = 0; i < n_append; ++i) append_slots[i] = 16 + i % 8;
  const std::vector<uint16_t> ak = RandomBf16(&rng, n_append * row_elems);
  const std::vector<uint16_t> av = RandomBf16(&rng, n_append * row_elems);
  // 3000 query rows over pages 0-5 (24 keys), causal with the diagonal at
  // rows 2100..2123 (512-byte rows: 2048 rows a chunk); then 2 rows, not
  // causal, over 10 keys.
  const int32_t total_q = 3002;
  const std::vector<uint16_t> q = RandomBf16(&rng, int64_t{total_q} * g.num_qo_heads * g.head_dim);
  const std::vector<int32_t> kv_indices = {0, 1, 2, 3, 4, 5, 0, 1, 2};
  std::vector<PrefillSeq> seqs(2);
  seqs[0].q_len = 3000;
  seqs[0].kv_len = 24;
  seqs[0].causal_shift = 876;  // row i sees j <= i - 2100
  seqs[1].q_start = 3000;
  seqs[1].q_len = 2;
  seqs[1].kv_start = 6;
  seqs[1].kv_len = 10;
  seqs[1].causal = 0;
  for (PrefillSeq& s : seqs) {
    s.layer = 1;
    s.sm_scale = 0.125f;
  }

  // Runs WriteKV, a Prefill with a fused append, and reads the rows back:
  // inputs contiguous (mode 0), in pieces (1) or contiguous at odd
  // addresses (2).
  struct Result {
    std::vector<uint16_t> o, k_back, v_back;
    std::vector<float> lse;
  };
  auto run = [&](int mode) {
    auto backend = CpuBackend::Create(g);
    EXPECT_TRUE(backend.ok());
    ValuePieces k_pieces(k, 1), v_pieces(v, 2), q_pieces(q, 3), ak_pieces(ak, 4), av_pieces(av, 5);
    const std::string k_odd = Misaligned(k), v_odd = Misaligned(v), q_odd = Misaligned(q);
    const std::string ak_odd = Misaligned(ak), av_odd = Misaligned(av);
    KvRows rows;
    rows.layer = 1;
    rows.slots = slots.data();
    rows.n = n;
    if (mode == 0) {
      rows.k = const_cast<uint16_t*>(k.data());
      rows.v = const_cast<uint16_t*>(v.data());
    } else if (mode == 1) {
      rows.k_scattered = k_pieces.list;
      rows.v_scattered = v_pieces.list;
    } else {
      rows.k = const_cast<char*>(k_odd.data() + 1);
      rows.v = const_cast<char*>(v_odd.data() + 1);
    }
    EXPECT_TRUE((*backend)->WriteKv(rows, nullptr).ok());

    Result r;
    r.o.assign(q.size(), 0);
    r.lse.assign(size_t{total_q} * g.num_qo_heads, 0.f);
    PrefillTask t;
    t.layer = 1;
    t.total_q = total_q;
    t.seqs = seqs;
    t.kv_indices = kv_indices.data();
    t.num_kv_indices = static_cast<int32_t>(kv_indices.size());
    t.append_slots = append_slots.data();
    t.num_append = n_append;
    if (mode == 0) {
      t.q = q.data();
      t.append_k = ak.data();
      t.append_v = av.data();
    } else if (mode == 1) {
      t.q_scattered = q_pieces.list;
      t.append_k_scattered = ak_pieces.list;
      t.append_v_scattered = av_pieces.list;
    } else {
      t.q = q_odd.data() + 1;
      t.append_k = ak_odd.data() + 1;
      t.append_v = av_odd.data() + 1;
    }
    t.o = r.o.data();
    t.lse = r.lse.data();
    EXPECT_TRUE((*backend)->Submit({t}, nullptr).ok());
    EXPECT_TRUE((*backend)->Complete(nullptr).ok());

    std::vector<int64_t> all(24);
    for (int64_t i = 0; i < 24; ++i) all[i] = i;
    r.k_back.assign(all.size() * g.RowElems(), 0);
    r.v_back.assign(all.size() * g.RowElems(), 0);
    KvRows read;
    read.layer = 1;
    read.slots = all.data();
    read.n = static_cast<int64_t>(all.size());
    read.k = r.k_back.data();
    read.v = r.v_back.data();
    EXPECT_TRUE((*backend)->ReadKv(read, nullptr).ok());
    return r;
  };
  const Result contiguous = run(0);
  // The rows read back are the last rows written to each slot: WriteKV's
  // rows 4992..4999 (slots 0..7) and 4984..4991 (8..15), then the append's
  // rows 4096..4099 (slots 16..19) and 4092..4095 (20..23).
  std::vector<uint16_t> k_all, v_all;
  auto take = [&](const std::vector<uint16_t>& from, int64_t row, std::vector<uint16_t>* to) {
    to->insert(to->end(), from.begin() + row * row_elems, from.begin() + (row + 1) * row_elems);
  };
  for (int64_t slot = 0; slot < 16; ++slot) {
    const int64_t row = slot < 8 ? 4992 + slot : 4984 + slot - 8;
    ASSERT_EQ(slots[row], slot);
    take(k, row, &k_all);
    take(v, row, &v_all);
  }
  for (int64_t slot = 16; slot < 24; ++slot) {
    const int64_t row = slot < 20 ? 4096 + slot - 16 : 4092 + slot - 20;
    ASSERT_EQ(append_slots[row], slot);
    take(ak, row, &k_all);
    take(av, row, &v_all);
  }
  EXPECT_TRUE(contiguous.k_back == k_all);
  EXPECT_TRUE(contiguous.v_back == v_all);
  for (int mode : {1, 2}) {
    SCOPED_TRACE(mode);
    const Result r = run(mode);
    EXPECT_TRUE(r.k_back == k_all);
    EXPECT_TRUE(r.v_back == v_all);
    EXPECT_TRUE(r.o == contiguous.o);
    EXPECT_EQ(std::memcmp(r.lse.data(), contiguous.lse.data(), r.lse.size() * 4), 0);
  }
  // Not a vacuous comparison: rows before the diagonal see no key (zero
  // output, LSE -inf), the others have outputs.
  const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim;
  int nonzero_before = 0, nonzero_after = 0;
  for (int64_t i = 0; i < int64_t{total_q} * q_row; ++i) {
    (i < 2100 * q_row ? nonzero_before : nonzero_after) += contiguous.o[i] != 0;
  }
  EXPECT_EQ(nonzero_before, 0);
  EXPECT_GT(nonzero_after, (total_q - 2100) * q_row / 2);
  EXPECT_EQ(contiguous.lse[2099 * g.num_qo_heads], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isfinite(contiguous.lse[2100 * g.num_qo_heads]));
}

// A task whose caller may give up (PrefillTask::given_up): the kernel asks
// before each part of its work. Never giving up gives the bits of a task
// that cannot (however the work is cut: 72 items over 600 keys, so that
// items are split on a host of many threads); giving up stops the rest,
// leaving rows unwritten, and the batch counts the task.
TEST(CpuBackendTest, ATaskWhoseCallerGivesUpStopsAndOtherwiseGivesTheSameBits) {
  KvGeometry g = Geo();
  g.num_pages = 160;
  std::mt19937 rng(5);
  const int64_t rows_kv = int64_t{g.num_pages} * g.page_size;
  std::vector<int64_t> all(rows_kv);
  for (int64_t i = 0; i < rows_kv; ++i) all[i] = i;
  const std::vector<uint16_t> k = RandomBf16(&rng, rows_kv * g.RowElems());
  const std::vector<uint16_t> v = RandomBf16(&rng, rows_kv * g.RowElems());
  // Six sequences of 96 rows over 600 keys (150 pages each, shuffled).
  const int32_t seqs_n = 6, q_len = 96, kv_len = 600;
  const int32_t total_q = seqs_n * q_len;
  const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim;
  const std::vector<uint16_t> q = RandomBf16(&rng, total_q * q_row);
  std::vector<int32_t> kv_indices;
  std::vector<PrefillSeq> seqs(seqs_n);
  for (int32_t b = 0; b < seqs_n; ++b) {
    std::vector<int32_t> pages(150);
    for (int32_t i = 0; i < 150; ++i) pages[i] = (i * 7 + b * 13) % g.num_pages;
    seqs[b].q_start = b * q_len;
    seqs[b].q_len = q_len;
    seqs[b].kv_start = static_cast<int32_t>(kv_indices.size());
    seqs[b].kv_len = kv_len;
    seqs[b].layer = 1;
    seqs[b].sm_scale = 0.125f;
    seqs[b].causal = b % 2;
    kv_indices.insert(kv_indices.end(), pages.begin(), pages.end());
  }
  struct Result {
    std::vector<uint16_t> o;
    std::vector<float> lse;
    std::atomic<int> calls{0};
    BatchStats stats;
  };
  // given_up: absent (mode 0), never true (1), true from its `stop_at`th call (2).
  auto run = [&](int mode, int stop_at, Result* r) {
    auto backend = CpuBackend::Create(g);
    ASSERT_TRUE(backend.ok());
    KvRows rows;
    rows.layer = 1;
    rows.slots = all.data();
    rows.n = rows_kv;
    rows.k = const_cast<uint16_t*>(k.data());
    rows.v = const_cast<uint16_t*>(v.data());
    ASSERT_TRUE((*backend)->WriteKv(rows, nullptr).ok());
    r->o.assign(q.size(), 0x7fc1);  // NaN
    r->lse.assign(size_t{total_q} * g.num_qo_heads, 12345.f);
    PrefillTask t;
    t.layer = 1;
    t.total_q = total_q;
    t.seqs = seqs;
    t.kv_indices = kv_indices.data();
    t.num_kv_indices = static_cast<int32_t>(kv_indices.size());
    t.q = q.data();
    t.o = r->o.data();
    t.lse = r->lse.data();
    if (mode == 1) t.given_up = [r] { return ++r->calls < 0; };
    if (mode == 2) t.given_up = [r, stop_at] { return ++r->calls >= stop_at; };
    ASSERT_TRUE((*backend)->Submit({t}, nullptr).ok());
    ASSERT_TRUE((*backend)->Complete(&r->stats).ok());
  };
  Result whole, asked, stopped, never_begun;
  run(0, 0, &whole);
  for (uint16_t h : whole.o) ASSERT_NE(h, 0x7fc1);
  run(1, 0, &asked);
  EXPECT_GT(asked.calls.load(), 1);
  EXPECT_EQ(asked.stats.given_up_tasks, 0);
  EXPECT_TRUE(asked.o == whole.o);
  EXPECT_EQ(std::memcmp(asked.lse.data(), whole.lse.data(), whole.lse.size() * 4), 0);
  // Given up at the tenth look: what was computed is the same bits, and
  // some rows were never computed.
  run(2, 10, &stopped);
  EXPECT_EQ(stopped.stats.given_up_tasks, 1);
  int64_t unwritten = 0;
  for (size_t i = 0; i < whole.o.size(); ++i) {
    if (stopped.o[i] == 0x7fc1) {
      ++unwritten;
    } else {
      ASSERT_EQ(stopped.o[i], whole.o[i]) << i;
    }
  }
  EXPECT_GT(unwritten, 0);
  // Given up before anything: nothing is written.
  run(2, 1, &never_begun);
  EXPECT_EQ(never_begun.stats.given_up_tasks, 1);
  for (uint16_t h : never_begun.o) ASSERT_EQ(h, 0x7fc1);
}

}  // namespace
}  // namespace attnserve
