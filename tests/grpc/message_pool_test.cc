// The Prefill edge's wire handling: RecyclingPool with ResetForReuse gives
// back a request that parses exactly like a fresh one while reusing its
// buffers; EncodePrefillResponse produces the bytes the generated serializer
// would, sent from the output buffer without a copy; pools stay in bounds.
#include "server/grpc/message_pool.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "gtest/gtest.h"
#include "server/grpc/convert.h"
#include "server/backend/host_buffer.h"

namespace attnserve {
namespace {

using Pool = RecyclingPool<v1::PrefillRequest>;

int64_t Reset(v1::PrefillRequest* r) { return ResetForReuse(r); }

v1::PrefillRequest MakeRequest(size_t q_bytes, int indices, bool with_optionals, uint32_t seed) {
  std::mt19937 rng(seed);
  v1::PrefillRequest r;
  r.set_layer(static_cast<int32_t>(rng() % 7));
  r.mutable_q()->set_dtype(v1::DTYPE_BF16);
  r.mutable_q()->add_shape(static_cast<int64_t>(q_bytes / 256));
  r.mutable_q()->add_shape(8);
  r.mutable_q()->add_shape(16);
  std::string q(q_bytes, '\0');
  for (char& c : q) c = static_cast<char>(rng());
  r.mutable_q()->set_data(q);
  r.add_qo_indptr(0);
  r.add_qo_indptr(static_cast<int32_t>(q_bytes / 256));
  r.add_kv_indptr(0);
  r.add_kv_indptr(indices);
  for (int i = 0; i < indices; ++i) r.add_kv_indices(static_cast<int32_t>(rng() % 1000));
  r.add_kv_last_page_len(3);
  if (with_optionals) {
    r.set_sm_scale(0.25f);
    r.set_causal(false);
    r.set_lse_base(v1::LSE_BASE_E);
    r.add_append_slots(17);
    r.mutable_append_k()->set_dtype(v1::DTYPE_BF16);
    r.mutable_append_k()->set_data(std::string(64, 'k'));
    r.mutable_append_v()->set_data(std::string(64, 'v'));
    r.set_expected_incarnation(99);
    r.add_kv_keys_after(5);
  }
  return r;
}

grpc::ByteBuffer ToWireBytes(const google::protobuf::MessageLite& m) {
  const std::string bytes = m.SerializeAsString();
  // Several slices, as gRPC hands over a large message: fields straddle them.
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size(); at += 1000) {
    slices.emplace_back(bytes.data() + at, std::min<size_t>(1000, bytes.size() - at));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer Bytes(const std::string& s) {
  grpc::Slice slice(s.data(), s.size());
  return grpc::ByteBuffer(&slice, 1);
}

// Bounds far above what these tests send.
const RequestWireLimits& Limits() {
  static const RequestWireLimits* limits = new RequestWireLimits(1 << 20, 1 << 22, 1 << 20, 256);
  return *limits;
}

TEST(PrefillWireTest, RecycledRequestParsesLikeAFreshOneAndReusesItsQueryBuffer) {
  Pool pool(4, 1 << 20, Reset);
  const v1::PrefillRequest first = MakeRequest(100000, 300, /*with_optionals=*/true, 1);
  const char* q_buffer = nullptr;
  {
    Pool::Ptr r = pool.Get();
    ASSERT_TRUE(ParseInto(ToWireBytes(first), Limits().prefill, r.get()).ok());
    EXPECT_EQ(r->SerializeAsString(), first.SerializeAsString());
    q_buffer = r->q().data().data();
  }
  EXPECT_EQ(pool.pooled(), 1u);
  EXPECT_GE(pool.pooled_bytes(), 100000 + 300 * 4);

  // A smaller request without the optional fields: nothing of the first may
  // show through (has_sm_scale, causal, appends, incarnation, longer arrays).
  const v1::PrefillRequest second = MakeRequest(50000, 10, /*with_optionals=*/false, 2);
  Pool::Ptr r = pool.Get();
  EXPECT_EQ(pool.pooled(), 0u);
  EXPECT_EQ(pool.pooled_bytes(), 0);
  ASSERT_TRUE(ParseInto(ToWireBytes(second), Limits().prefill, r.get()).ok());
  EXPECT_EQ(r->q().data(), second.q().data());
  EXPECT_EQ(r->q().data().data(), q_buffer) << "the query buffer was not reused";
  EXPECT_FALSE(r->has_sm_scale());
  EXPECT_FALSE(r->has_causal());
  EXPECT_EQ(r->lse_base(), v1::LSE_BASE_2);
  EXPECT_EQ(r->expected_incarnation(), 0u);
  EXPECT_EQ(r->append_slots_size(), 0);
  EXPECT_TRUE(r->append_k().data().empty());
  EXPECT_EQ(r->append_k().dtype(), v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(r->kv_indices_size(), 10);
  // The kept (empty) tensors serialize as present; every value equals the
  // fresh parse's, so the core sees the same request.
  v1::PrefillRequest fresh;
  ASSERT_TRUE(fresh.ParseFromString(second.SerializeAsString()));
  r->clear_append_k();
  r->clear_append_v();
  EXPECT_EQ(r->SerializeAsString(), fresh.SerializeAsString());
}

TEST(PrefillWireTest, GarbageDoesNotParse) {
  Pool pool(1, 1 << 20, Reset);
  Pool::Ptr r = pool.Get();
  const char bad[] = {'\x0a', '\x7f', 'x'};  // field 1 claims 127 bytes, has 1
  grpc::Slice slice(bad, sizeof(bad));
  EXPECT_FALSE(ParseInto(grpc::ByteBuffer(&slice, 1), Limits().prefill, r.get()).ok());
}


TEST(PrefillWireTest, FieldsClaimingMoreBytesThanTheMessageHoldsAreRejectedUnparsed) {
  // Valid requests, in one slice or many, pass.
  const v1::PrefillRequest valid = MakeRequest(3000, 40, /*with_optionals=*/true, 3);
  EXPECT_TRUE(CheckWire(ToWireBytes(valid), Limits().prefill).ok());
  EXPECT_TRUE(CheckWire(Bytes(valid.SerializeAsString()), Limits().prefill).ok());
  EXPECT_TRUE(CheckWire(Bytes(""), Limits().prefill).ok());
  // q (field 2) claims 1 GiB and holds 16 bytes: protobuf alone would
  // reserve 50 MB for its data before failing.
  const std::string big_q = std::string("\x12\x80\x80\x80\x80\x04", 6) +
                            std::string("\x1a\xf0\xff\xff\xff\x03", 6) + std::string(10, 'x');
  // An unknown length-delimited field (127) claiming 1 GiB.
  const std::string big_unknown = std::string("\xfa\x07\x80\x80\x80\x80\x04", 7) + "yyyy";
  // A start-group tag (field 1, wire type 3); a truncated varint.
  const std::string group("\x0b\x0c", 2);
  const std::string truncated("\x08\xff", 2);
  // A nested claim beyond its parent: q holds 6 bytes, its data claims 1 GiB.
  const std::string nested_over = std::string("\x12\x06\x1a\x80\x80\x80\x80\x04", 8);
  for (const std::string& bad : {big_q, big_unknown, group, truncated, nested_over}) {
    EXPECT_TRUE(absl::IsInvalidArgument(CheckWire(Bytes(bad), Limits().prefill)));
    v1::PrefillRequest r;
    EXPECT_FALSE(ParseInto(Bytes(bad), Limits().prefill, &r).ok());
  }
}

TEST(RecyclingPoolTest, StaysWithinItsCountAndByteBounds) {
  Pool pool(2, 1 << 20, Reset);
  {
    // An object holding more than the byte bound is deleted, not kept.
    Pool::Ptr big = pool.Get();
    big->mutable_q()->mutable_data()->assign(2 << 20, 'q');
  }
  EXPECT_EQ(pool.pooled(), 0u);
  EXPECT_EQ(pool.pooled_bytes(), 0);
  {
    std::vector<Pool::Ptr> held;
    for (int i = 0; i < 3; ++i) {
      held.push_back(pool.Get());
      held.back()->mutable_q()->mutable_data()->assign(1000, 'q');
    }
  }
  EXPECT_EQ(pool.pooled(), 2u);
  EXPECT_LE(pool.pooled_bytes(), 1 << 20);
}

TEST(PrefillWireTest, EncodedResponseEqualsTheGeneratedSerialization) {
  const int64_t total_q = 5;
  const int32_t heads = 4, dim = 64;
  for (bool pinned : {false, true}) {
    PrefillOutput out;
    out.dtype = KvDType::kFp16;
    out.total_q = total_q;
    out.num_qo_heads = heads;
    out.v_head_dim = dim;
    out.o_bytes = total_q * heads * dim * KvDTypeBytes(out.dtype);
    out.lse_offset = (out.o_bytes + 63) / 64 * 64;
    out.lse_bytes = total_q * heads * 4;
    out.buffer = HeapBuffer(out.lse_offset + out.lse_bytes);
    ASSERT_NE(out.buffer.data(), nullptr);
    std::mt19937 rng(pinned ? 7 : 8);
    for (int64_t i = 0; i < out.buffer.size(); ++i) out.buffer.data()[i] = static_cast<char>(rng());

    v1::PrefillResponse expected;
    expected.mutable_output()->set_dtype(v1::DTYPE_FP16);
    for (int64_t d : {total_q, int64_t{heads}, int64_t{dim}}) expected.mutable_output()->add_shape(d);
    expected.mutable_output()->set_data(out.buffer.data(), out.o_bytes);
    expected.mutable_lse()->set_dtype(v1::DTYPE_FP32);
    for (int64_t d : {total_q, int64_t{heads}}) expected.mutable_lse()->add_shape(d);
    expected.mutable_lse()->set_data(out.buffer.data() + out.lse_offset, out.lse_bytes);
    expected.set_incarnation(0x1234567890abcdefULL);

    const char* data = out.buffer.data();
    grpc::ByteBuffer wire = EncodePrefillResponse(std::move(out), 0x1234567890abcdefULL);
    EXPECT_EQ(Flatten(wire), expected.SerializeAsString());
    // Sent from the buffer itself, not a copy.
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(wire.Dump(&slices).ok());
    bool points_into_buffer = false;
    for (const grpc::Slice& s : slices) {
      if (reinterpret_cast<const char*>(s.begin()) == data) points_into_buffer = true;
    }
    EXPECT_TRUE(points_into_buffer);
  }
}

TEST(PrefillWireTest, EmptyOutputsEncodeAsTheGeneratedSerialization) {
  PrefillOutput out;  // total_q 0: no buffer, no data fields
  out.dtype = KvDType::kBf16;
  out.num_qo_heads = 8;
  out.v_head_dim = 128;
  grpc::ByteBuffer wire = EncodePrefillResponse(std::move(out), 3);
  v1::PrefillResponse expected;
  expected.mutable_output()->set_dtype(v1::DTYPE_BF16);
  for (int64_t d : {0, 8, 128}) expected.mutable_output()->add_shape(d);
  expected.mutable_lse()->set_dtype(v1::DTYPE_FP32);
  for (int64_t d : {0, 8}) expected.mutable_lse()->add_shape(d);
  expected.set_incarnation(3);
  EXPECT_EQ(Flatten(wire), expected.SerializeAsString());
}

// The buffer goes back to its source only when the last slice is dropped.
class CountingSource final : public BufferSource {
 public:
  void Release(void* data, int64_t) override {
    ++released;
    std::free(data);
  }
  int released = 0;
};

TEST(PrefillWireTest, OutputBufferIsReleasedWithTheLastSlice) {
  auto source = std::make_shared<CountingSource>();
  PrefillOutput out;
  out.total_q = 1;
  out.num_qo_heads = 4;
  out.v_head_dim = 128;
  out.o_bytes = 1024;
  out.lse_offset = 1024;
  out.lse_bytes = 64;
  out.buffer = HostBuffer(std::malloc(1088), 1088, 1088, false, source);
  std::vector<grpc::Slice> slices;
  {
    grpc::ByteBuffer wire = EncodePrefillResponse(std::move(out), 1);
    ASSERT_TRUE(wire.Dump(&slices).ok());  // the slices hold references too
  }
  EXPECT_EQ(source->released, 0);
  slices.clear();
  EXPECT_EQ(source->released, 1);
}

TEST(SizeClassPoolTest, ReusesBlocksByClassAndFallsBackToTheHeapAtItsBound) {
  int allocations = 0, frees = 0;
  SizeClassPool::Allocator alloc;
  alloc.allocate = [&](int64_t bytes) {
    ++allocations;
    return std::malloc(static_cast<size_t>(bytes));
  };
  alloc.free = [&](void* p) {
    ++frees;
    std::free(p);
  };
  alloc.pinned = true;
  {
    auto pool = SizeClassPool::Create(alloc, int64_t{1} << 20);
    EXPECT_EQ(SizeClassPool::ClassBytes(1), 64 << 10);
    EXPECT_EQ(SizeClassPool::ClassBytes(65 << 10), 96 << 10);
    EXPECT_EQ(SizeClassPool::ClassBytes(97 << 10), 128 << 10);
    EXPECT_EQ(SizeClassPool::ClassBytes(129 << 10), 192 << 10);
    EXPECT_EQ(SizeClassPool::ClassBytes(520 << 10), 768 << 10);
    void* first = nullptr;
    {
      HostBuffer a = pool->Get(520 << 10);
      EXPECT_TRUE(a.pinned());
      EXPECT_EQ(a.size(), 520 << 10);
      first = a.data();
      std::memset(a.data(), 1, a.size());  // the whole size is usable
    }
    EXPECT_EQ(pool->pooled_blocks(), 1);
    HostBuffer b = pool->Get(600 << 10);  // same class: the same block
    EXPECT_EQ(b.data(), first);
    EXPECT_EQ(allocations, 1);
    // 768 KiB are out; another 768 KiB block would pass the 1 MiB bound.
    HostBuffer c = pool->Get(700 << 10);
    EXPECT_NE(c.data(), nullptr);
    EXPECT_FALSE(c.pinned());
    EXPECT_EQ(pool->heap_fallbacks(), 1);
    HostBuffer d = pool->Get(100 << 10);  // 128 KiB still fits
    EXPECT_TRUE(d.pinned());
    EXPECT_EQ(pool->allocated_bytes(), (768 + 128) << 10);
  }
  // Buffers hold the pool; once all are gone the pool frees its blocks.
  EXPECT_EQ(frees, allocations);
}

}  // namespace
}  // namespace attnserve
