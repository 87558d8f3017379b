// Every malformed request gets its code and a message naming the field, and
// changes nothing (two tenants, a 1 MiB message limit).
#include "tests/integration/server_fixture.h"

namespace attnserve {
namespace server_test {
namespace {

// One malformed request: what it is, how it is sent, and the answer it must get.
struct Rejection {
  std::string name;
  std::function<grpc::Status()> send;
  grpc::StatusCode code;
  std::string field;  // the message must contain it ("" for auth failures)
};

TEST_P(AuthServerTest, EveryMalformedRequestGetsItsCodeAndChangesNothing) {
  std::mt19937_64 gen(GetParam() + 50);
  const int32_t ps = geo_.page_size;
  const int32_t count = GetParam() == 1 ? 64 : 4;
  auto alice_pages = alice_->AllocatePages(count);
  auto bob_pages = bob_->AllocatePages(count);
  ASSERT_TRUE(alice_pages.ok() && bob_pages.ok());
  KvMirror alice_kv(geo_), bob_kv(geo_);
  for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
    ASSERT_NO_FATAL_FAILURE(FillPages(*alice_, alice_kv, gen, layer, *alice_pages));
    ASSERT_NO_FATAL_FAILURE(FillPages(*bob_, bob_kv, gen, layer, *bob_pages));
  }
  const Snapshot alice_before = Read(*alice_, geo_, *alice_pages);
  const Snapshot bob_before = Read(*bob_, geo_, *bob_pages);
  const int32_t free_before = alice_->GetServerInfo()->free_pages();

  // Valid requests (sent at the end, to prove that each rejection below is
  // due to its one broken field).
  const PrefillInputs in = EdgeCaseInputs(gen, geo_, *alice_pages, 1, true, false, 2, 16, 60);
  const std::vector<int64_t> alice_slots = SlotsOfPages(geo_, *alice_pages);
  const std::vector<int64_t> bob_slots = SlotsOfPages(geo_, *bob_pages);
  const std::vector<int64_t> append_slots = {alice_slots[3], alice_slots[0], alice_slots[7]};
  const auto ak = RandomHalves(gen, geo_.dtype, 3 * geo_.RowElems());
  const auto av = RandomHalves(gen, geo_.dtype, 3 * geo_.RowElems());
  const v1::PrefillRequest prefill = PrefillProto(geo_, in, append_slots, ak, av);

  v1::WriteKVRequest write;
  write.set_layer(0);
  const std::vector<int64_t> write_slots = {alice_slots[5], alice_slots[2]};
  write.mutable_slots()->Add(write_slots.begin(), write_slots.end());
  const auto wk = RandomHalves(gen, geo_.dtype, 2 * geo_.RowElems());
  const auto wv = RandomHalves(gen, geo_.dtype, 2 * geo_.RowElems());
  SetTensor(write.mutable_k(), v1::DTYPE_BF16, {2, geo_.num_kv_heads, geo_.head_dim}, wk.data(),
            wk.size() * sizeof(uint16_t));
  SetTensor(write.mutable_v(), v1::DTYPE_BF16, {2, geo_.num_kv_heads, geo_.head_dim}, wv.data(),
            wv.size() * sizeof(uint16_t));

  v1::ReadKVRequest read;
  read.set_layer(1);
  read.add_slots(alice_slots[1]);
  read.add_slots(alice_slots[4]);

  v1::MergeStatesRequest merge;
  const std::vector<uint16_t> mv = RandomHalves(gen, geo_.dtype, 2 * 8 * 64);
  const std::vector<float> ml(2 * 8, 0.5f);
  for (int i = 0; i < 2; ++i) {
    v1::AttentionState* st = merge.add_states();
    SetTensor(st->mutable_v(), v1::DTYPE_BF16, {2, 8, 64}, mv.data(), mv.size() * sizeof(uint16_t));
    SetTensor(st->mutable_lse(), v1::DTYPE_FP32, {2, 8}, ml.data(), ml.size() * 4);
  }

  v1::AllocatePagesRequest alloc;
  alloc.set_count(1);
  v1::FreePagesRequest free_req;
  free_req.add_page_ids((*alice_pages)[0]);

  const auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  const auto kDenied = grpc::StatusCode::PERMISSION_DENIED;
  const auto kUnauth = grpc::StatusCode::UNAUTHENTICATED;
  const auto kExhausted = grpc::StatusCode::RESOURCE_EXHAUSTED;
  const int32_t seq_with_pages = [&] {
    for (size_t b = 0; b + 1 < in.kv_indptr.size(); ++b) {
      if (in.kv_indptr[b + 1] > in.kv_indptr[b]) return static_cast<int32_t>(b);
    }
    return -1;
  }();
  ASSERT_GE(seq_with_pages, 0);

  // Each case edits a copy of a valid request.
  auto P = [&](Who who, std::function<void(v1::PrefillRequest&)> edit) {
    return [this, who, edit, prefill] {
      v1::PrefillRequest r = prefill;
      edit(r);
      return Send(who, r);
    };
  };
  auto W = [&](Who who, std::function<void(v1::WriteKVRequest&)> edit) {
    return [this, who, edit, write] {
      v1::WriteKVRequest r = write;
      edit(r);
      return Send(who, r);
    };
  };
  auto R = [&](Who who, std::function<void(v1::ReadKVRequest&)> edit) {
    return [this, who, edit, read] {
      v1::ReadKVRequest r = read;
      edit(r);
      return Send(who, r);
    };
  };
  auto M = [&](Who who, std::function<void(v1::MergeStatesRequest&)> edit) {
    return [this, who, edit, merge] {
      v1::MergeStatesRequest r = merge;
      edit(r);
      return Send(who, r);
    };
  };
  auto A = [&](Who who, int32_t n) {
    return [this, who, n] {
      v1::AllocatePagesRequest r;
      r.set_count(n);
      return Send(who, r);
    };
  };
  auto F = [&](Who who, std::vector<int32_t> ids) {
    return [this, who, ids] {
      v1::FreePagesRequest r;
      r.mutable_page_ids()->Add(ids.begin(), ids.end());
      return Send(who, r);
    };
  };
  const int32_t num_pages = geo_.num_pages;
  const int64_t num_slots = int64_t{num_pages} * ps;
  auto none = [](auto&) {};

  // Prefill bytes that are not a PrefillRequest: truncated, a field claiming
  // 1 GiB that is not there (rejected before anything is reserved for it).
  const std::string wire = prefill.SerializeAsString();
  const std::string truncated = wire.substr(0, wire.size() / 2);
  const std::string claims_1gib = std::string("\x12\x80\x80\x80\x80\x04", 6) +
                                  std::string("\x1a\xf0\xff\xff\xff\x03", 6) + "xyz";
  auto Raw = [this](Who who, std::string bytes) {
    return [this, who, bytes] { return SendRawPrefill(who, bytes); };
  };
  const std::vector<Rejection> cases = {
      {"Prefill truncated bytes", Raw(Who::kAlice, truncated), kInvalid, "does not parse"},
      {"Prefill field claiming 1 GiB", Raw(Who::kAlice, claims_1gib), kInvalid, "does not parse"},
      {"Prefill raw bytes without a token", Raw(Who::kNoToken, claims_1gib), kUnauth, ""},
      // Prefill: every field.
      {"Prefill layer", P(Who::kAlice, [](auto& r) { r.set_layer(2); }), kInvalid, "layer"},
      {"Prefill q.dtype", P(Who::kAlice, [](auto& r) { r.mutable_q()->set_dtype(v1::DTYPE_FP16); }),
       kInvalid, "q.dtype"},
      {"Prefill q.shape", P(Who::kAlice, [](auto& r) { r.mutable_q()->set_shape(1, 4); }),
       kInvalid, "q.shape"},
      {"Prefill q.data", P(Who::kAlice, [](auto& r) { r.mutable_q()->mutable_data()->pop_back(); }),
       kInvalid, "q.data"},
      {"Prefill qo_indptr end",
       P(Who::kAlice, [](auto& r) { r.set_qo_indptr(r.qo_indptr_size() - 1, 1 << 20); }),
       kInvalid, "qo_indptr"},
      {"Prefill qo_indptr missing", P(Who::kAlice, [](auto& r) { r.clear_qo_indptr(); }),
       kInvalid, "qo_indptr"},
      {"Prefill kv_indptr size", P(Who::kAlice, [](auto& r) { r.add_kv_indptr(1 << 20); }),
       kInvalid, "kv_indptr"},
      {"Prefill kv_indptr decreasing",
       P(Who::kAlice, [&](auto& r) { r.set_kv_indptr(seq_with_pages + 1, -1); }), kInvalid,
       "kv_indptr"},
      {"Prefill kv_indices too large",
       P(Who::kAlice, [&](auto& r) { r.set_kv_indices(0, num_pages); }), kInvalid, "kv_indices"},
      {"Prefill kv_indices negative", P(Who::kAlice, [](auto& r) { r.set_kv_indices(0, -1); }),
       kInvalid, "kv_indices"},
      {"Prefill kv_last_page_len size",
       P(Who::kAlice, [](auto& r) { r.add_kv_last_page_len(1); }), kInvalid, "kv_last_page_len"},
      {"Prefill kv_last_page_len over page",
       P(Who::kAlice, [&](auto& r) { r.set_kv_last_page_len(seq_with_pages, ps + 1); }), kInvalid,
       "kv_last_page_len"},
      {"Prefill kv_last_page_len zero",
       P(Who::kAlice, [&](auto& r) { r.set_kv_last_page_len(seq_with_pages, 0); }), kInvalid,
       "kv_last_page_len"},
      {"Prefill sm_scale",
       P(Who::kAlice, [](auto& r) { r.set_sm_scale(std::numeric_limits<float>::quiet_NaN()); }),
       kInvalid, "sm_scale"},
      {"Prefill lse_base",
       P(Who::kAlice, [](auto& r) { r.set_lse_base(static_cast<v1::LseBase>(7)); }), kInvalid,
       "lse_base"},
      {"Prefill append_slots range",
       P(Who::kAlice, [&](auto& r) { r.set_append_slots(1, num_slots); }), kInvalid,
       "append_slots"},
      {"Prefill append_slots repeated",
       P(Who::kAlice, [](auto& r) { r.set_append_slots(2, r.append_slots(0)); }), kInvalid,
       "append_slots"},
      {"Prefill append_k shape",
       P(Who::kAlice, [](auto& r) { r.mutable_append_k()->set_shape(0, 2); }), kInvalid,
       "append_k"},
      {"Prefill append_v dtype",
       P(Who::kAlice, [](auto& r) { r.mutable_append_v()->set_dtype(v1::DTYPE_FP32); }),
       kInvalid, "append_v"},
      {"Prefill append without rows",
       P(Who::kAlice, [](auto& r) { r.clear_append_v(); }), kInvalid, "append_v"},
      {"Prefill expected_incarnation",
       P(Who::kAlice,
         [&](auto& r) { r.set_expected_incarnation(alice_->info().incarnation() + 1); }),
       grpc::StatusCode::FAILED_PRECONDITION, "expected_incarnation"},
      {"Prefill response over max_message_bytes",
       P(Who::kAlice,
         [&](auto& r) {
           // 1000 rows of q fit a 1 MiB request; output plus LSE do not fit the response.
           const int64_t rows = 1000;
           const std::vector<uint16_t> q = RandomHalves(gen, geo_.dtype, rows * 8 * 64);
           r.Clear();
           SetTensor(r.mutable_q(), v1::DTYPE_BF16, {rows, 8, 64}, q.data(), q.size() * sizeof(uint16_t));
           r.add_qo_indptr(0);
           r.add_qo_indptr(rows);
           r.add_kv_indptr(0);
           r.add_kv_indptr(0);
           r.add_kv_last_page_len(0);
         }),
       kExhausted, "max_message_bytes"},
      // Prefill: pages of another tenant, by either side.
      {"Prefill kv_indices of bob",
       P(Who::kAlice, [&](auto& r) { r.set_kv_indices(0, (*bob_pages)[1]); }), kDenied,
       "kv_indices"},
      {"Prefill append_slots of bob",
       P(Who::kAlice, [&](auto& r) { r.set_append_slots(1, bob_slots[2]); }), kDenied,
       "append_slots"},
      {"Prefill by bob on alice's pages", P(Who::kBob, none), kDenied, "kv_indices"},
      {"Prefill without token", P(Who::kNoToken, none), kUnauth, ""},
      {"Prefill with unknown token", P(Who::kUnknownToken, none), kUnauth, ""},
      {"Prefill with Basic scheme", P(Who::kWrongScheme, none), kUnauth, ""},
      // WriteKV.
      {"WriteKV layer", W(Who::kAlice, [](auto& r) { r.set_layer(-1); }), kInvalid, "layer"},
      {"WriteKV slots range", W(Who::kAlice, [&](auto& r) { r.set_slots(0, num_slots); }),
       kInvalid, "slots"},
      {"WriteKV slots negative", W(Who::kAlice, [](auto& r) { r.set_slots(1, -4); }), kInvalid,
       "slots"},
      {"WriteKV slots repeated", W(Who::kAlice, [](auto& r) { r.set_slots(1, r.slots(0)); }),
       kInvalid, "slots"},
      {"WriteKV k.shape", W(Who::kAlice, [](auto& r) { r.mutable_k()->set_shape(2, 32); }),
       kInvalid, "k.shape"},
      {"WriteKV v.dtype", W(Who::kAlice, [](auto& r) { r.mutable_v()->set_dtype(v1::DTYPE_FP16); }),
       kInvalid, "v.dtype"},
      {"WriteKV k.data", W(Who::kAlice, [](auto& r) { r.mutable_k()->mutable_data()->resize(10); }),
       kInvalid, "k.data"},
      {"WriteKV into bob's slot", W(Who::kAlice, [&](auto& r) { r.set_slots(1, bob_slots[0]); }),
       kDenied, "slots"},
      {"WriteKV by bob into alice's slots", W(Who::kBob, none), kDenied, "slots"},
      {"WriteKV without token", W(Who::kNoToken, none), kUnauth, ""},
      // ReadKV.
      {"ReadKV layer", R(Who::kAlice, [](auto& r) { r.set_layer(9); }), kInvalid, "layer"},
      {"ReadKV slots range", R(Who::kAlice, [&](auto& r) { r.set_slots(1, num_slots + 5); }),
       kInvalid, "slots"},
      {"ReadKV slots repeated", R(Who::kAlice, [](auto& r) { r.add_slots(r.slots(0)); }),
       kInvalid, "slots"},
      {"ReadKV by bob of alice's slots", R(Who::kBob, none), kDenied, "slots"},
      {"ReadKV without token", R(Who::kNoToken, none), kUnauth, ""},
      // MergeStates.
      {"MergeStates no states", M(Who::kAlice, [](auto& r) { r.clear_states(); }), kInvalid,
       "states"},
      {"MergeStates lse_base",
       M(Who::kAlice, [](auto& r) { r.set_lse_base(static_cast<v1::LseBase>(9)); }), kInvalid,
       "lse_base"},
      {"MergeStates v.shape",
       M(Who::kAlice, [](auto& r) { r.mutable_states(1)->mutable_v()->set_shape(2, 32); }),
       kInvalid, "states[1].v"},
      {"MergeStates v.dtype",
       M(Who::kAlice,
         [](auto& r) { r.mutable_states(0)->mutable_v()->set_dtype(v1::DTYPE_FP16); }),
       kInvalid, "states[0].v.dtype"},
      {"MergeStates lse.dtype",
       M(Who::kAlice,
         [](auto& r) { r.mutable_states(1)->mutable_lse()->set_dtype(v1::DTYPE_BF16); }),
       kInvalid, "states[1].lse"},
      {"MergeStates lse NaN",
       M(Who::kAlice,
         [](auto& r) {
           const float nan = std::numeric_limits<float>::quiet_NaN();
           std::memcpy(r.mutable_states(0)->mutable_lse()->mutable_data()->data() + 12, &nan, 4);
         }),
       kInvalid, "states[0].lse"},
      {"MergeStates n overflowing int64",
       M(Who::kAlice,
         [](auto& r) {
           const int64_t n = (int64_t{1} << 53) + 1;
           const std::string bytes(4096, '\0');
           for (int i = 0; i < 2; ++i) {
             SetTensor(r.mutable_states(i)->mutable_v(), v1::DTYPE_BF16, {n, 1024, 2},
                       bytes.data(), bytes.size());
             SetTensor(r.mutable_states(i)->mutable_lse(), v1::DTYPE_FP32, {n, 1024},
                       bytes.data(), bytes.size());
           }
         }),
       kInvalid, "states[0].v.shape"},
      {"MergeStates without token", M(Who::kNoToken, none), kUnauth, ""},
      // AllocatePages / FreePages / GetServerInfo.
      {"AllocatePages count 0", A(Who::kAlice, 0), kInvalid, "count"},
      {"AllocatePages count negative", A(Who::kAlice, -3), kInvalid, "count"},
      {"AllocatePages more than free", A(Who::kBob, num_pages - 2 * count + 1), kExhausted,
       "count"},
      {"AllocatePages without token", A(Who::kNoToken, 1), kUnauth, ""},
      {"FreePages out of range", F(Who::kAlice, {num_pages}), kInvalid, "page_ids"},
      {"FreePages repeated", F(Who::kAlice, {(*alice_pages)[0], (*alice_pages)[0]}), kInvalid,
       "page_ids"},
      {"FreePages of alice by bob", F(Who::kBob, {(*alice_pages)[0]}), kDenied, "page_ids"},
      {"FreePages own and bob's", F(Who::kAlice, {(*alice_pages)[1], (*bob_pages)[0]}), kDenied,
       "page_ids"},
      {"FreePages without token", F(Who::kNoToken, {(*alice_pages)[0]}), kUnauth, ""},
      {"GetServerInfo without token",
       [this] { return Send(Who::kNoToken, v1::GetServerInfoRequest()); }, kUnauth, ""},
      {"GetServerInfo with unknown token",
       [this] { return Send(Who::kUnknownToken, v1::GetServerInfoRequest()); }, kUnauth, ""},
  };

  for (const Rejection& c : cases) {
    const grpc::Status s = c.send();
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(c.field)) << c.name;
    ASSERT_TRUE(server_->Alive()) << c.name << " killed the server:\n" << server_->Output();
  }

  // Nothing either tenant wrote changed, and no page changed hands.
  EXPECT_TRUE(Read(*alice_, geo_, *alice_pages) == alice_before);
  EXPECT_TRUE(Read(*bob_, geo_, *bob_pages) == bob_before);
  EXPECT_EQ(alice_->GetServerInfo()->free_pages(), free_before);

  // The server still serves correct results: the valid requests succeed.
  {
    grpc::ClientContext ctx;
    Prepare(Who::kAlice, &ctx);
    v1::PrefillResponse resp;
    grpc::Status s = alice_->stub()->Prefill(&ctx, prefill, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    alice_kv.Write(1, append_slots, ak, av);
    PrefillResult out;
    out.o.resize(resp.output().data().size() / 2);
    std::memcpy(out.o.data(), resp.output().data().data(), resp.output().data().size());
    out.lse.resize(resp.lse().data().size() / 4);
    std::memcpy(out.lse.data(), resp.lse().data().data(), resp.lse().data().size());
    EXPECT_GT(ExpectMatchesReference(alice_kv, in, out), 0);
  }
  ASSERT_TRUE(Send(Who::kAlice, write).ok());
  auto back = alice_->ReadKV(0, write_slots);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->k == wk && back->v == wv);
  EXPECT_TRUE(Send(Who::kAlice, read).ok());
  EXPECT_TRUE(Send(Who::kAlice, merge).ok());
  EXPECT_TRUE(Send(Who::kAlice, alloc).ok());
  EXPECT_TRUE(Send(Who::kAlice, free_req).ok());
  // Bob's data is still his, exactly.
  EXPECT_TRUE(Read(*bob_, geo_, *bob_pages) == bob_before);
}

}  // namespace
}  // namespace server_test
}  // namespace attnserve
