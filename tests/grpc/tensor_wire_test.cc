// The zero-copy wire encoding (common/tensor_wire.h, server/grpc/convert.h)
// against protobuf's generated code: what is written parses as the same
// message, byte-exact, and what is read from many small slices equals what
// was sent.
#include "common/tensor_wire.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "gtest/gtest.h"
#include "server/grpc/convert.h"

namespace attnserve {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

// The generated parser's view of wire bytes.
template <typename Message>
Message Parse(grpc::ByteBuffer* bytes) {
  Message m;
  EXPECT_TRUE(grpc::SerializationTraits<Message>::Deserialize(bytes, &m).ok());
  return m;
}

std::string Flatten(const grpc::ByteBuffer& bytes) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bytes.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `wire` cut into slices of random sizes from 1 to max_slice bytes (tags,
// varints and data split anywhere), as gRPC hands a large message over.
grpc::ByteBuffer Chop(const std::string& wire, size_t max_slice, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < wire.size();) {
    const size_t n = std::min<size_t>(wire.size() - at, 1 + rng() % max_slice);
    slices.emplace_back(wire.data() + at, n);
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(TensorWireTest, BorrowedRequestParsesAsTheGeneratedMessageByteExact) {
  const std::string q = RandomBytes(3 << 20, 1);  // 3 MiB: a slice of its own
  const std::string k = RandomBytes(64 * 2 * 64 * 2, 2);
  v1::PrefillRequest small;
  small.set_layer(3);
  small.add_qo_indptr(0);
  small.add_qo_indptr(12288);
  small.set_expected_incarnation(~uint64_t{0} - 5);
  BorrowedMemory borrowed;
  grpc::ByteBuffer bytes;
  {
    WireWriter w;
    w.AppendCopy(small.SerializeAsString());
    w.AppendTensor(2, v1::DTYPE_BF16, {12288, 2, 64}, borrowed.Borrow(q.data(), q.size()),
                   q.size());
    w.AppendTensorCopy(11, v1::DTYPE_BF16, {64, 2, 64}, k.data(), k.size());
    w.AppendTensor(12, v1::DTYPE_BF16, {64, 2, 64}, borrowed.Borrow(k.data(), k.size()),
                   k.size());
    bytes = w.Finish();
  }
  EXPECT_EQ(borrowed.outstanding(), 2);
  grpc::ByteBuffer copy(bytes);  // the generated parser consumes its buffer
  const auto m = Parse<v1::PrefillRequest>(&copy);
  EXPECT_EQ(m.layer(), 3);
  EXPECT_THAT(m.qo_indptr(), testing::ElementsAre(0, 12288));
  EXPECT_EQ(m.expected_incarnation(), ~uint64_t{0} - 5);
  EXPECT_EQ(m.q().dtype(), v1::DTYPE_BF16);
  EXPECT_THAT(m.q().shape(), testing::ElementsAre(12288, 2, 64));
  EXPECT_TRUE(m.q().data() == q) << "query bytes differ";
  EXPECT_TRUE(m.append_k().data() == k);
  EXPECT_TRUE(m.append_v().data() == k);
  // Field by field, the bytes the generated serializer writes.
  auto alone = [](int field, const std::vector<int64_t>& shape, const std::string& data) {
    v1::PrefillRequest r;
    v1::Tensor* t = field == 2 ? r.mutable_q() : field == 11 ? r.mutable_append_k()
                                                             : r.mutable_append_v();
    t->set_dtype(v1::DTYPE_BF16);
    for (int64_t s : shape) t->add_shape(s);
    t->set_data(data);
    return r.SerializeAsString();
  };
  EXPECT_TRUE(Flatten(bytes) == small.SerializeAsString() + alone(2, {12288, 2, 64}, q) +
                                    alone(11, {64, 2, 64}, k) + alone(12, {64, 2, 64}, k));
  // gRPC releases the borrowed memory with the last reference to the bytes.
  bytes.Clear();
  copy.Clear();
  EXPECT_EQ(borrowed.outstanding(), 0);
  borrowed.WaitReleased();
}

TEST(TensorWireTest, NestedStatesParseAsMergeStatesRequest) {
  const std::string v0 = RandomBytes(40 << 10, 3), v1b = RandomBytes(40 << 10, 4);
  const std::string l0 = RandomBytes(5 << 10, 5), l1 = RandomBytes(5 << 10, 6);
  BorrowedMemory borrowed;
  WireWriter w;
  for (const auto* st : {&v0, &v1b}) {
    const std::string& lse = st == &v0 ? l0 : l1;
    w.AppendLengthPrefix(1, TensorFieldSize(1, v1::DTYPE_BF16, {320, 2, 32}, st->size()) +
                                TensorFieldSize(2, v1::DTYPE_FP32, {320, 4}, lse.size()));
    w.AppendTensor(1, v1::DTYPE_BF16, {320, 2, 32}, borrowed.Borrow(st->data(), st->size()),
                   st->size());
    w.AppendTensorCopy(2, v1::DTYPE_FP32, {320, 4}, lse.data(), lse.size());
  }
  grpc::ByteBuffer bytes = w.Finish();
  const auto m = Parse<v1::MergeStatesRequest>(&bytes);
  ASSERT_EQ(m.states_size(), 2);
  EXPECT_TRUE(m.states(0).v().data() == v0);
  EXPECT_TRUE(m.states(1).v().data() == v1b);
  EXPECT_TRUE(m.states(0).lse().data() == l0);
  EXPECT_TRUE(m.states(1).lse().data() == l1);
  EXPECT_THAT(m.states(1).lse().shape(), testing::ElementsAre(320, 4));
}

// A response of many small slices (as gRPC receives 128 MiB) read into the
// caller's memory, for several slice sizes, against the generated encoding.
TEST(TensorWireTest, ReadsAMultiSliceResponseByteExact) {
  v1::PrefillResponse resp;
  const std::string o = RandomBytes((1 << 20) + 7 * 2, 7);  // odd element count
  const std::string lse = RandomBytes(12 << 10, 8);
  resp.mutable_output()->set_dtype(v1::DTYPE_FP16);
  for (int64_t s : {int64_t{4103}, int64_t{2}, int64_t{64}}) resp.mutable_output()->add_shape(s);
  resp.mutable_output()->set_data(o);
  resp.mutable_lse()->set_dtype(v1::DTYPE_FP32);
  resp.mutable_lse()->add_shape(-1);  // negative: sign-extended varint
  resp.mutable_lse()->set_data(lse);
  resp.set_incarnation(0x8000000000000001ull);
  const std::string wire = resp.SerializeAsString();
  for (size_t max_slice : {size_t{1}, size_t{13}, size_t{8192}, size_t{1} << 22}) {
    SCOPED_TRACE(max_slice);
    grpc::ByteBuffer bytes = Chop(wire, max_slice, static_cast<uint32_t>(max_slice));
    std::vector<uint16_t> got_o;
    std::vector<float> got_lse;
    ReceivedTensor a, b;
    uint64_t incarnation = 0;
    auto into16 = [&](size_t n) -> void* {
      got_o.resize(n / 2);
      return got_o.data();
    };
    auto into32 = [&](size_t n) -> void* {
      got_lse.resize(n / 4);
      return got_lse.data();
    };
    ASSERT_TRUE(ReadTensorResponse(bytes, "PrefillResponse", &a, into16, &b, into32,
                                   &incarnation)
                    .ok());
    EXPECT_EQ(incarnation, 0x8000000000000001ull);
    EXPECT_TRUE(a.present && b.present);
    EXPECT_EQ(a.dtype, v1::DTYPE_FP16);
    EXPECT_THAT(a.shape, testing::ElementsAre(4103, 2, 64));
    EXPECT_THAT(b.shape, testing::ElementsAre(-1));
    ASSERT_EQ(a.bytes, o.size());
    EXPECT_EQ(std::memcmp(got_o.data(), o.data(), o.size()), 0);
    ASSERT_EQ(b.bytes, lse.size());
    EXPECT_EQ(std::memcmp(got_lse.data(), lse.data(), lse.size()), 0);
  }
}

TEST(TensorWireTest, RejectsTruncatedAndRefusedResponses) {
  v1::ReadKVResponse resp;
  resp.mutable_k()->set_data(RandomBytes(100, 9));
  resp.mutable_v()->set_data(RandomBytes(100, 10));
  const std::string wire = resp.SerializeAsString();
  std::vector<char> sink(200);
  auto into = [&](size_t n) -> void* { return n <= sink.size() ? sink.data() : nullptr; };
  ReceivedTensor a, b;
  uint64_t incarnation;
  for (size_t cut : {size_t{1}, size_t{50}, wire.size() - 1}) {
    grpc::ByteBuffer bytes = Chop(wire.substr(0, cut), 7, 1);
    const absl::Status s = ReadTensorResponse(bytes, "ReadKVResponse", &a, into, &b, into,
                                              &incarnation);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << cut;
    EXPECT_THAT(std::string(s.message()), testing::HasSubstr("ReadKVResponse"));
  }
  // A sink that refuses the size (not whole elements) fails the message.
  grpc::ByteBuffer bytes = Chop(wire, 7, 2);
  auto refuse = [](size_t) -> void* { return nullptr; };
  EXPECT_EQ(ReadTensorResponse(bytes, "ReadKVResponse", &a, into, &b, refuse, &incarnation).code(),
            absl::StatusCode::kInvalidArgument);
}

// Server responses sent from the backend's memory: larger than one slice,
// parsed by the generated code byte-exact.
TEST(TensorWireTest, ServerResponsesReferenceTheirDataAndParse) {
  auto kv = std::make_unique<v1::ReadKVResponse>();
  const std::string k = RandomBytes(5 << 20, 11), v = RandomBytes(100, 12);
  kv->mutable_k()->set_data(k);
  kv->mutable_v()->set_data(v);
  SetTensorHeader(kv->mutable_k(), v1::DTYPE_BF16, {int64_t{20480}, int64_t{2}, int64_t{64}});
  SetTensorHeader(kv->mutable_v(), v1::DTYPE_BF16, {int64_t{25}, int64_t{2}});
  kv->set_incarnation(42);
  const char* k_data = kv->k().data().data();
  grpc::ByteBuffer bytes = EncodeTensorResponse(std::move(kv));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(bytes.Dump(&slices).ok());
  ASSERT_GE(slices.size(), 3u);
  bool referenced = false;
  for (const grpc::Slice& s : slices) referenced |= s.begin() == reinterpret_cast<const uint8_t*>(k_data);
  EXPECT_TRUE(referenced) << "the 5 MiB tensor was copied, not referenced";
  const auto m = Parse<v1::ReadKVResponse>(&bytes);
  EXPECT_TRUE(m.k().data() == k);
  EXPECT_TRUE(m.v().data() == v);
  EXPECT_THAT(m.k().shape(), testing::ElementsAre(20480, 2, 64));
  EXPECT_EQ(m.incarnation(), 42u);

  auto merged = std::make_unique<v1::MergeStatesResponse>();
  const std::string mv = RandomBytes(1 << 20, 13), ml = RandomBytes(1 << 18, 14);
  merged->mutable_v()->set_data(mv);
  merged->mutable_lse()->set_data(ml);
  SetTensorHeader(merged->mutable_v(), v1::DTYPE_BF16, {int64_t{4096}, int64_t{2}, int64_t{64}});
  SetTensorHeader(merged->mutable_lse(), v1::DTYPE_FP32, {int64_t{4096}, int64_t{16}});
  v1::MergeStatesResponse expect = *merged;
  grpc::ByteBuffer merged_bytes = EncodeTensorResponse(std::move(merged));
  EXPECT_EQ(Flatten(merged_bytes), expect.SerializeAsString());
}

TEST(TensorWireTest, PrefillResponseEqualsTheGeneratedSerialization) {
  PrefillOutput out;
  out.dtype = KvDType::kBf16;
  out.total_q = 300;
  out.num_qo_heads = 4;
  out.v_head_dim = 64;
  out.o_bytes = 300 * 4 * 64 * 2;
  out.lse_offset = out.o_bytes;
  out.lse_bytes = 300 * 4 * 4;
  out.buffer = HeapBuffer(out.o_bytes + out.lse_bytes);
  const std::string data = RandomBytes(out.o_bytes + out.lse_bytes, 15);
  std::memcpy(out.buffer.data(), data.data(), data.size());
  v1::PrefillResponse expect;
  expect.mutable_output()->set_data(data.substr(0, out.o_bytes));
  SetTensorHeader(expect.mutable_output(), v1::DTYPE_BF16,
                  {int64_t{300}, int64_t{4}, int64_t{64}});
  expect.mutable_lse()->set_data(data.substr(out.o_bytes));
  SetTensorHeader(expect.mutable_lse(), v1::DTYPE_FP32, {int64_t{300}, int64_t{4}});
  expect.set_incarnation(7);
  grpc::ByteBuffer bytes = EncodePrefillResponse(std::move(out), 7);
  EXPECT_EQ(Flatten(bytes), expect.SerializeAsString());
}

}  // namespace
}  // namespace attnserve
