// Tensors of MiBs through the real server: the paths where the client sends
// from the caller's memory (tensors of 16 KiB and more) and reads responses
// that arrive in many slices, and where the server sends ReadKV and
// MergeStates results from the backend's buffers. Every byte is checked
// against what was sent or against the float64 reference.
#include "common/scatter_list.h"
#include "tests/integration/server_fixture.h"

namespace attnserve {
namespace server_test {
namespace {

TEST_P(ServerTest, MiBKvRowsRoundTripByteExact) {
  std::mt19937_64 gen(GetParam() + 300);
  // 4096 or 8192 slots: 1 or 2 MiB per tensor.
  auto pages = client_->AllocatePages(GetParam() == 1 ? 4096 : 512);
  ASSERT_TRUE(pages.ok()) << pages.status();
  std::vector<int64_t> slots = SlotsOfPages(geo_, *pages);
  std::shuffle(slots.begin(), slots.end(), gen);
  const int64_t elems = static_cast<int64_t>(slots.size()) * geo_.RowElems();
  ASSERT_GE(elems * 2, int64_t{1} << 20);
  const std::vector<uint16_t> k = RandomHalves(gen, geo_.dtype, elems);
  const std::vector<uint16_t> v = RandomHalves(gen, geo_.dtype, elems);
  ASSERT_TRUE(client_->WriteKV(1, slots, k, v).ok());
  auto back = client_->ReadKV(1, slots);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->k == k);
  EXPECT_TRUE(back->v == v);
  // A second read of the same rows (the server's buffers are reused).
  std::vector<int64_t> half(slots.begin(), slots.begin() + slots.size() / 2);
  auto again = client_->ReadKV(1, half);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(std::equal(again->v.begin(), again->v.end(), v.begin()));
  EXPECT_EQ(again->v.size(), half.size() * geo_.RowElems());
}

TEST_P(ServerTest, OutputsPastTheThreadedCopyThresholdComeBackWhole) {
  // An output of 1.5 x kParallelCopyMinBytes: the client gathers it from the
  // slices gRPC received it in over several threads (common/tensor_wire.cc),
  // each thread a part of whole pages; every row against the reference.
  std::mt19937_64 gen(GetParam() + 500);
  KvMirror mirror(geo_);
  const int32_t kv_len = 40;
  const int32_t num_pages = (kv_len + geo_.page_size - 1) / geo_.page_size;
  auto pages = client_->AllocatePages(num_pages);
  ASSERT_TRUE(pages.ok()) << pages.status();
  FillPages(*client_, mirror, gen, 0, *pages);
  const int64_t row_bytes = int64_t{geo_.num_qo_heads} * geo_.head_dim * KvDTypeBytes(geo_.dtype);
  const int32_t rows = static_cast<int32_t>(kParallelCopyMinBytes * 3 / 2 / row_bytes);
  PrefillInputs in;
  in.causal = false;
  in.qo_indptr = {0, rows};
  in.kv_indptr = {0, num_pages};
  in.kv_indices = *pages;
  in.kv_last_page_len = {kv_len - (num_pages - 1) * geo_.page_size};
  in.q = RandomHalves(gen, geo_.dtype, int64_t{rows} * geo_.num_qo_heads * geo_.head_dim);
  PrefillResult out;
  for (int round = 0; round < 2; ++round) {  // into a fresh result, then into the same one
    // Poisoned: a byte the copy misses is a NaN the comparison counts.
    std::fill(out.o.begin(), out.o.end(), uint16_t{0x7fff});
    std::fill(out.lse.begin(), out.lse.end(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(client_->PrefillInto(ArgsOf(in), &out).ok());
    ASSERT_GE(static_cast<int64_t>(out.o.size()) * 2, kParallelCopyMinBytes);
    ExpectMatchesReference(mirror, in, out);
  }
}

TEST_P(ServerTest, MiBPrefillMatchesTheReference) {
  std::mt19937_64 gen(GetParam() + 400);
  KvMirror mirror(geo_);
  WorkloadSpec spec;
  spec.batch = 48;
  spec.max_q_len = 96;
  spec.max_kv_len = 160;
  auto pages = client_->AllocatePages(static_cast<int32_t>(PagesNeeded(geo_, spec)));
  ASSERT_TRUE(pages.ok()) << pages.status();
  FillPages(*client_, mirror, gen, 0, *pages);
  PrefillInputs in = RandomPrefill(gen, geo_, spec, *pages);
  ASSERT_GE(in.q.size() * 2, size_t{256} << 10) << "the query should be a borrowed slice";
  auto out = client_->Prefill(ArgsOf(in));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_GT(ExpectMatchesReference(mirror, in, *out), 0);
  // PrefillInto one result, reused: larger, smaller and empty outputs each
  // come back whole, with nothing left over from the previous request.
  PrefillResult reused;
  for (int32_t batch : {16, 3, 24, 0}) {
    SCOPED_TRACE(batch);
    spec.batch = batch;
    PrefillInputs next = RandomPrefill(gen, geo_, spec, *pages);
    ASSERT_TRUE(client_->PrefillInto(ArgsOf(next), &reused).ok());
    ASSERT_EQ(reused.o.size(), next.q.size());
    if (batch > 0) EXPECT_GT(ExpectMatchesReference(mirror, next, reused), 0);
  }
}

TEST_P(ServerTest, MiBMergeStatesMatchesTheReference) {
  std::mt19937_64 gen(GetParam() + 500);
  const int64_t n = 2048;  // 2 MiB of v per state
  const int32_t h = geo_.num_qo_heads, d = geo_.head_dim;
  std::vector<State> states(3);
  std::uniform_real_distribution<float> lse_dist(-20.f, 20.f);
  for (State& s : states) {
    s.v = RandomHalves(gen, geo_.dtype, n * h * d);
    s.lse.resize(n * h);
    for (float& l : s.lse) l = lse_dist(gen);
  }
  auto out = client_->MergeStates(states, n, h, d, /*lse_base_e=*/false);
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<double> v_ref, lse_ref;
  ReferenceMerge(states, n * h, d, geo_.dtype, false, &v_ref, &lse_ref);
  const Comparison c = Compare(geo_.dtype, v_ref, lse_ref, out->v, out->lse);
  EXPECT_TRUE(c.Ok(geo_.dtype)) << c.ToString();
  EXPECT_EQ(out->v.size(), static_cast<size_t>(n * h * d));
  EXPECT_EQ(out->lse.size(), static_cast<size_t>(n * h));
}

}  // namespace
}  // namespace server_test
}  // namespace attnserve
