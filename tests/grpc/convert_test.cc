// The edge's in-place parse (server/grpc/convert.h): Prefill's and WriteKV's
// tensors are viewed in the slices their request arrived in, never copied,
// and everything else parses exactly as protobuf parses it. Each request is
// cut into slices of several sizes (fields and tensors split anywhere), and
// the result is compared with ParseInto's copying parse: both accept or both
// reject with the same status, and accepted messages are equal once the
// viewed data is put back. Truncated, overlong and garbled messages are
// rejected with INVALID_ARGUMENT, never a crash.
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "common/tensor_wire.h"
#include "gmock/gmock.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "server/grpc/convert.h"
#include "server/grpc/wire_limits.h"

namespace attnserve {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

const RequestWireLimits& Limits() {
  static const RequestWireLimits* limits = new RequestWireLimits(1 << 20, 1 << 22, 1 << 20, 256);
  return *limits;
}

// `wire` as gRPC could hand it over: slices of 1 to max_slice bytes (one
// slice when max_slice covers it all) that
// reference `wire` itself (borrowed: nothing is copied, so views into the
// slices are views into `wire`).
grpc::ByteBuffer Borrowed(const std::string& wire, size_t max_slice, uint32_t seed,
                          BorrowedMemory* borrowed) {
  std::mt19937 rng(seed);
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < wire.size();) {
    const size_t n = max_slice >= wire.size()
                         ? wire.size()
                         : std::min<size_t>(wire.size() - at, 1 + rng() % max_slice);
    slices.push_back(borrowed->Borrow(wire.data() + at, n));
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// The same, copied into gRPC-owned slices (small ones are inlined in the
// grpc_slice itself).
grpc::ByteBuffer Copied(const std::string& wire, size_t max_slice, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < wire.size();) {
    const size_t n = max_slice >= wire.size()
                         ? wire.size()
                         : std::min<size_t>(wire.size() - at, 1 + rng() % max_slice);
    slices.emplace_back(wire.data() + at, n);
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// A view's bytes, wherever they are.
std::string Bytes(const TensorView& v) {
  if (v.scattered.empty()) return std::string(v.data);
  std::string out(static_cast<size_t>(v.scattered.size), '\0');
  int64_t at = 0;
  for (const ScatterPiece& p : v.scattered.pieces) {
    EXPECT_EQ(p.offset, at);
    EXPECT_GT(p.size, 0);
    std::memcpy(&out[static_cast<size_t>(at)], p.data, static_cast<size_t>(p.size));
    at += p.size;
  }
  EXPECT_EQ(at, v.scattered.size);
  return out;
}

// The in-place tensor fields of each request type and where they live.
v1::Tensor* TensorField(v1::PrefillRequest* r, uint32_t field) {
  return field == 2 ? r->mutable_q() : field == 11 ? r->mutable_append_k() : r->mutable_append_v();
}
v1::Tensor* TensorField(v1::WriteKVRequest* r, uint32_t field) {
  return field == 3 ? r->mutable_k() : r->mutable_v();
}
absl::Span<const uint32_t> InPlace(const v1::PrefillRequest&) { return kPrefillInPlace; }
absl::Span<const uint32_t> InPlace(const v1::WriteKVRequest&) { return kWriteKvInPlace; }
const WireMessage& LimitsOf(const v1::PrefillRequest&) { return Limits().prefill; }
const WireMessage& LimitsOf(const v1::WriteKVRequest&) { return Limits().write_kv; }

// Parses `bytes` in place and by copying; they must agree. Returns the
// in-place status; on success *out is the message with the viewed data put
// back, and `tensors` holds the views.
template <typename M>
absl::Status ParseBothWays(const grpc::ByteBuffer& bytes, M* out, InPlaceTensors* tensors,
                           const WireMessage* limits = nullptr) {
  M copied;
  if (limits == nullptr) limits = &LimitsOf(copied);
  const absl::Status copied_status = ParseInto(bytes, *limits, &copied);
  M in_place;
  const absl::Status status = ParseInto(bytes, *limits, InPlace(in_place), &in_place, tensors);
  EXPECT_EQ(status, copied_status);
  if (!status.ok()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    return status;
  }
  for (uint32_t field : InPlace(in_place)) {
    TensorView view;
    if (!tensors->View(field, &view)) continue;
    v1::Tensor* t = TensorField(&in_place, field);
    EXPECT_TRUE(t->data().empty()) << "field " << field << " was copied into the message";
    t->set_data(Bytes(view));
  }
  EXPECT_EQ(in_place.SerializeAsString(), copied.SerializeAsString());
  *out = in_place;
  return status;
}

v1::PrefillRequest RandomPrefill(size_t q_bytes, size_t kv_bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  v1::PrefillRequest r;
  r.set_layer(3);
  r.mutable_q()->set_dtype(v1::DTYPE_BF16);
  for (int64_t d : {int64_t(q_bytes / 256), int64_t{8}, int64_t{16}}) r.mutable_q()->add_shape(d);
  r.mutable_q()->set_data(RandomBytes(q_bytes, seed + 1));
  for (int i = 0; i < 5; ++i) r.add_qo_indptr(i * 3);
  for (int i = 0; i < 5; ++i) r.add_kv_indptr(i * 7);
  for (int i = 0; i < 28; ++i) r.add_kv_indices(static_cast<int32_t>(rng() % 1000));
  for (int i = 0; i < 4; ++i) r.add_kv_last_page_len(1 + i);
  r.set_sm_scale(0.125f);
  r.set_causal(false);
  r.set_lse_base(v1::LSE_BASE_E);
  for (size_t i = 0; i < kv_bytes / 512; ++i) {
    r.add_append_slots(static_cast<int64_t>(rng() % 4096));
  }
  r.mutable_append_k()->set_dtype(v1::DTYPE_BF16);
  r.mutable_append_k()->add_shape(static_cast<int64_t>(kv_bytes / 512));
  r.mutable_append_k()->set_data(RandomBytes(kv_bytes, seed + 2));
  r.mutable_append_v()->set_dtype(v1::DTYPE_BF16);
  r.mutable_append_v()->add_shape(static_cast<int64_t>(kv_bytes / 512));
  r.mutable_append_v()->set_data(RandomBytes(kv_bytes, seed + 3));
  r.set_expected_incarnation(0xfedcba9876543210ull);
  r.add_kv_keys_after(2);
  return r;
}

bool Within(const char* p, int64_t n, const std::string& memory) {
  return p >= memory.data() && p + n <= memory.data() + memory.size();
}

TEST(InPlaceParseTest, PrefillTensorsAreViewedInTheSlicesAndTheRestParsesAsProtobuf) {
  const v1::PrefillRequest request = RandomPrefill(100000, 5120, 1);
  const std::string wire = request.SerializeAsString();
  for (size_t max_slice : {size_t{1}, size_t{7}, size_t{1000}, size_t{65536}, wire.size()}) {
    SCOPED_TRACE(max_slice);
    BorrowedMemory borrowed;
    InPlaceTensors tensors;
    {
      grpc::ByteBuffer bytes = Borrowed(wire, max_slice, static_cast<uint32_t>(max_slice),
                                        &borrowed);
      v1::PrefillRequest parsed;
      ASSERT_TRUE(ParseBothWays(bytes, &parsed, &tensors).ok());
      EXPECT_EQ(parsed.SerializeAsString(), wire);
    }
    // The request's ByteBuffer is gone; the tensors still hold its slices
    // (the request's size, nothing more).
    EXPECT_GT(borrowed.outstanding(), 0);
    EXPECT_EQ(tensors.held_bytes(), static_cast<int64_t>(wire.size()));
    v1::PrefillRequest bare;
    PrefillCall call;
    ToCall(bare, tensors, &call);  // the message's other fields do not matter here
    for (const auto& [view, expect] : {std::pair{&call.q, &request.q().data()},
                                       std::pair{&call.append_k, &request.append_k().data()},
                                       std::pair{&call.append_v, &request.append_v().data()}}) {
      EXPECT_EQ(view->byte_size(), static_cast<int64_t>(expect->size()));
      EXPECT_TRUE(Bytes(*view) == *expect);
      // Views of `wire` itself: nothing was copied.
      if (view->scattered.empty()) {
        EXPECT_TRUE(Within(view->data.data(), view->byte_size(), wire));
      } else {
        for (const ScatterPiece& p : view->scattered.pieces) {
          EXPECT_TRUE(Within(p.data, p.size, wire));
          EXPECT_LE(p.size, static_cast<int64_t>(max_slice));
        }
      }
    }
    if (max_slice == wire.size()) {
      EXPECT_TRUE(call.q.scattered.empty()) << "one slice: one contiguous view";
    }
    if (max_slice <= 1000) {
      EXPECT_GE(call.q.scattered.pieces.size(), 100000 / max_slice);
    }
    tensors.Clear();
    EXPECT_EQ(borrowed.outstanding(), 0);  // the slices go with the tensors
  }
}

TEST(InPlaceParseTest, WireWriterRequestsAreViewedInTheCallersMemory) {
  // As the C++ client sends them: the small fields, then each tensor's head
  // and its data as a slice of the caller's memory.
  const std::string q = RandomBytes(3 << 20, 2), k = RandomBytes(4096, 3), v = RandomBytes(4096, 4);
  v1::PrefillRequest small;
  small.set_layer(1);
  small.add_qo_indptr(0);
  small.add_qo_indptr(12288);
  BorrowedMemory borrowed;
  InPlaceTensors tensors;
  {
    WireWriter w;
    w.AppendCopy(small.SerializeAsString());
    w.AppendTensor(2, v1::DTYPE_BF16, {12288, 2, 64}, borrowed.Borrow(q.data(), q.size()),
                   q.size());
    w.AppendTensor(11, v1::DTYPE_BF16, {16, 2, 64}, borrowed.Borrow(k.data(), k.size()), k.size());
    w.AppendTensorCopy(12, v1::DTYPE_BF16, {16, 2, 64}, v.data(), v.size());
    grpc::ByteBuffer bytes = w.Finish();
    v1::PrefillRequest parsed;
    ASSERT_TRUE(ParseBothWays(bytes, &parsed, &tensors).ok());
    EXPECT_THAT(parsed.q().shape(), testing::ElementsAre(12288, 2, 64));
  }
  v1::PrefillRequest bare;
  PrefillCall call;
  ToCall(bare, tensors, &call);
  EXPECT_EQ(call.q.data.data(), q.data());  // the caller's own bytes
  EXPECT_EQ(call.q.byte_size(), static_cast<int64_t>(q.size()));
  EXPECT_EQ(call.append_k.data.data(), k.data());
  EXPECT_TRUE(Bytes(call.append_v) == v);
  tensors.Clear();
  EXPECT_EQ(borrowed.outstanding(), 0);
}

TEST(InPlaceParseTest, WriteKvTensorsAreViewedInTheSlices) {
  v1::WriteKVRequest r;
  r.set_layer(2);
  for (int i = 0; i < 40; ++i) r.add_slots(i * 3);
  r.mutable_k()->set_dtype(v1::DTYPE_FP16);
  for (int64_t d : {40, 2, 64}) r.mutable_k()->add_shape(d);
  r.mutable_k()->set_data(RandomBytes(40 * 2 * 64 * 2, 5));
  r.mutable_v()->set_dtype(v1::DTYPE_FP16);
  for (int64_t d : {40, 2, 64}) r.mutable_v()->add_shape(d);
  r.mutable_v()->set_data(RandomBytes(40 * 2 * 64 * 2, 6));
  r.set_expected_incarnation(5);
  const std::string wire = r.SerializeAsString();
  for (size_t max_slice : {size_t{3}, size_t{500}, wire.size()}) {
    SCOPED_TRACE(max_slice);
    InPlaceTensors tensors;
    v1::WriteKVRequest parsed;
    ASSERT_TRUE(ParseBothWays(Copied(wire, max_slice, 9), &parsed, &tensors).ok());
    v1::WriteKVRequest bare;
    WriteKvCall call;
    ToCall(bare, tensors, &call);
    EXPECT_TRUE(Bytes(call.k) == r.k().data());
    EXPECT_TRUE(Bytes(call.v) == r.v().data());
    EXPECT_EQ(call.k.scattered.empty(), max_slice == wire.size());
  }
}

// Hand-made Tensor encodings a generated serializer never writes, all valid:
// fields out of order, the data field repeated (the last wins), shape half
// packed and half not, unknown fields, a region beside no data.
TEST(InPlaceParseTest, UnusualTensorEncodingsParseAsProtobuf) {
  const std::string first = RandomBytes(300, 7), last = RandomBytes(700, 8);
  auto len = [](uint32_t field, size_t n) {
    std::string s;
    AppendLengthPrefix(field, n, &s);
    return s;
  };
  std::string q;
  q += len(3, first.size()) + first;          // data, overwritten below
  q += std::string("\x08\x01", 2);            // dtype BF16
  q += std::string("\x10\x80\x01", 3);        // shape 128, unpacked
  q += len(2, 2) + std::string("\x02\x40", 2);  // shape 2, 64, packed
  q += std::string("\x48\x05", 2);            // unknown varint field 9
  q += len(15, 3) + "abc";                    // unknown bytes field 15
  q += len(3, last.size()) + last;            // data: this one counts
  q += len(3, 0);                             // and an empty one after it: the last wins
  v1::RegionRef region;
  region.set_name("shm");
  region.set_offset(64);
  region.set_byte_size(128);
  const std::string k = std::string("\x08\x01", 2) + len(4, region.ByteSizeLong()) +
                        region.SerializeAsString();
  const std::string v = len(3, last.size()) + last;
  std::string wire;
  wire += std::string("\x08\x04", 2);  // layer 4
  wire += len(12, v.size()) + v;       // append_v before q
  wire += len(2, q.size()) + q;
  wire += len(11, k.size()) + k;
  wire += len(3, 2) + std::string("\x00\x05", 2);  // qo_indptr
  for (size_t max_slice : {size_t{1}, size_t{5}, size_t{64}, wire.size()}) {
    SCOPED_TRACE(max_slice);
    InPlaceTensors tensors;
    v1::PrefillRequest parsed;
    ASSERT_TRUE(ParseBothWays(Copied(wire, max_slice, 3), &parsed, &tensors).ok());
    EXPECT_TRUE(parsed.q().data().empty());  // the last data field was empty
    EXPECT_THAT(parsed.q().shape(), testing::ElementsAre(128, 2, 64));
    EXPECT_EQ(parsed.append_k().region().name(), "shm");
    PrefillCall call;
    ToCall(parsed, tensors, &call);
    EXPECT_EQ(call.q.byte_size(), 0);
    EXPECT_EQ(call.append_k.byte_size(), 0);
    EXPECT_TRUE(call.append_k.region.set);
    EXPECT_EQ(call.append_k.region.byte_size, 128);
    EXPECT_TRUE(Bytes(call.append_v) == last);
  }
}

// Varints written longer than they need be: protobuf's parser takes a tag
// of up to 5 bytes and a length of up to 5 (the fifth below 8), where
// CodedInputStream takes up to 10. The tags and lengths the in-place parse
// takes out of protobuf's sight are held to protobuf's rules: each request
// below parses, or fails, as the copying parse does.
TEST(InPlaceParseTest, OverlongVarintsAreTakenAsProtobufTakesThem) {
  const std::string data = RandomBytes(40, 16);
  // n bytes encoding `value` (n - 1 bytes with the continuation bit, padded
  // with zero groups).
  auto overlong = [](uint64_t value, int n) {
    std::string out;
    for (int i = 0; i < n; ++i) {
      const uint8_t group = static_cast<uint8_t>(value & 0x7f);
      value >>= 7;
      out.push_back(static_cast<char>(i + 1 < n ? group | 0x80 : group));
    }
    return out;
  };
  struct Case {
    int q_tag, q_length, data_tag, data_length;  // bytes of each varint
    bool parses;
  };
  const Case cases[] = {
      {1, 1, 1, 1, true},  {2, 1, 1, 1, true},  {5, 1, 1, 1, true},  {6, 1, 1, 1, false},
      {1, 2, 1, 1, true},  {1, 5, 1, 1, true},  {1, 6, 1, 1, false}, {1, 9, 1, 1, false},
      {1, 1, 5, 1, true},  {1, 1, 6, 1, false}, {1, 1, 1, 5, true},  {1, 1, 1, 6, false},
      {1, 1, 3, 10, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.q_tag << " " << c.q_length << " " << c.data_tag << " "
                                    << c.data_length);
    const std::string tensor =
        overlong(26, c.data_tag) + overlong(data.size(), c.data_length) + data;
    const std::string wire = std::string("\x08\x02", 2) + overlong(18, c.q_tag) +
                             overlong(tensor.size(), c.q_length) + tensor;
    for (size_t max_slice : {size_t{1}, size_t{4}, wire.size()}) {
      InPlaceTensors tensors;
      v1::PrefillRequest parsed;
      const absl::Status s = ParseBothWays(Copied(wire, max_slice, 5), &parsed, &tensors);
      EXPECT_EQ(s.ok(), c.parses) << s;
      if (s.ok()) {
        EXPECT_TRUE(parsed.q().data() == data);
      }
    }
  }
  // A 5-byte data length whose fifth byte is 8 or more: 40 + 2^32, which
  // CodedInputStream reads as 40 (bits past 32 dropped) and protobuf refuses.
  const std::string too_long = std::string("\x12\x2e\x1a", 3) + "\xa8\x80\x80\x80\x10" + data;
  InPlaceTensors tensors;
  v1::PrefillRequest parsed;
  EXPECT_FALSE(ParseBothWays(Copied(too_long, 3, 6), &parsed, &tensors).ok());
}

// The server's wire limits refuse a tensor field sent twice; without them
// protobuf merges the occurrences (data: the last one present wins; shape:
// appended), and so does the in-place parse.
TEST(InPlaceParseTest, RepeatedTensorFieldsMergeAsProtobufWhereTheLimitsAllowThem) {
  const WireMessage loose{"attnserve.v1.PrefillRequest", {}};
  const std::string a = RandomBytes(50, 17), b = RandomBytes(70, 18);
  auto len = [](uint32_t field, size_t n) {
    std::string s;
    AppendLengthPrefix(field, n, &s);
    return s;
  };
  auto q = [&len](const std::string& body) { return len(2, body.size()) + body; };
  const std::string with_a = len(3, a.size()) + a, with_b = len(3, b.size()) + b;
  const std::string shape = std::string("\x10\x05", 2);
  struct Case {
    std::string wire;
    const std::string* data;
  };
  const Case cases[] = {
      {q(with_a) + q(shape), &a},             // the second has no data: the first's stays
      {q(with_a + shape) + q(with_b), &b},    // the last wins
      {q(with_a) + q(len(3, 0)), nullptr},    // an empty one present last wins too
      {q(shape) + q(shape + with_b) + q(shape), &b},
  };
  for (const Case& c : cases) {
    for (size_t max_slice : {size_t{2}, c.wire.size()}) {
      InPlaceTensors tensors;
      v1::PrefillRequest parsed;
      ASSERT_TRUE(ParseBothWays(Copied(c.wire, max_slice, 7), &parsed, &tensors, &loose).ok());
      EXPECT_TRUE(parsed.q().data() == (c.data != nullptr ? *c.data : std::string()));
    }
  }
  // The server's limits refuse them.
  InPlaceTensors tensors;
  v1::PrefillRequest parsed;
  EXPECT_FALSE(ParseBothWays(Copied(cases[0].wire, 3, 7), &parsed, &tensors).ok());
}

TEST(InPlaceParseTest, EmptyAndTensorlessRequestsParse) {
  InPlaceTensors tensors;
  v1::PrefillRequest parsed;
  ASSERT_TRUE(ParseBothWays(Copied("", 1, 1), &parsed, &tensors).ok());
  v1::PrefillRequest plain;
  plain.set_layer(1);
  plain.add_kv_indices(3);
  ASSERT_TRUE(ParseBothWays(Copied(plain.SerializeAsString(), 2, 1), &parsed, &tensors).ok());
  PrefillCall call;
  ToCall(parsed, tensors, &call);
  EXPECT_EQ(call.q.byte_size(), 0);
  EXPECT_FALSE(parsed.has_q());
}

// Every prefix of a request, in slices of 1 to 13 bytes: all but those that
// end on a field boundary are rejected, exactly as the copying parse rejects
// them.
TEST(InPlaceParseTest, TruncatedRequestsAreRejectedAsByTheCopyingParse) {
  const std::string wire = RandomPrefill(2048, 1024, 11).SerializeAsString();
  int rejected = 0;
  for (size_t cut = 0; cut < wire.size(); ++cut) {
    InPlaceTensors tensors;
    v1::PrefillRequest parsed;
    const grpc::ByteBuffer bytes = Copied(wire.substr(0, cut), 13, static_cast<uint32_t>(cut));
    const absl::Status s = ParseBothWays(bytes, &parsed, &tensors);
    if (!s.ok()) {
      ++rejected;
      EXPECT_THAT(std::string(s.message()), testing::HasSubstr("attnserve.v1.PrefillRequest"));
    }
  }
  EXPECT_GT(rejected, static_cast<int>(wire.size()) - 40);
}

TEST(InPlaceParseTest, LengthsBeyondTheMessageAreRefusedNamingTheField) {
  auto len = [](uint32_t field, uint64_t n) {
    std::string s;
    AppendLengthPrefix(field, n, &s);
    return s;
  };
  const std::string data(100, 'x');
  struct Case {
    std::string wire;
    const char* says;
  };
  const Case cases[] = {
      // q claims 1 GiB and holds 100 bytes.
      {len(2, 1u << 30) + len(3, 100) + data, "field 2 claims 1073741824 bytes"},
      // q's data claims more than q holds.
      {len(2, 103) + len(3, 4000) + data, "at q: field 3 claims 4000 bytes, only 100 follow"},
      // append_v's data claims more than the message holds, q is fine.
      {len(2, 102) + len(3, 100) + data + len(12, 6) + len(3, 300) + "abc",
       "at append_v: field 3 claims 300 bytes, only 3 follow"},
      // A truncated varint length inside append_k.
      {len(11, 2) + std::string("\x1a\xff", 2), "at append_k: truncated length"},
      // q appears twice.
      {len(2, 0) + len(2, 0), "q appears more than once"},
      // A data field of the wrong wire type is an unknown field; a group is
      // refused.
      {len(2, 2) + std::string("\x1b\x1c", 2), "unsupported wire type"},
  };
  for (const Case& c : cases) {
    for (size_t max_slice : {size_t{1}, size_t{9}, c.wire.size()}) {
      InPlaceTensors tensors;
      v1::PrefillRequest parsed;
      const absl::Status s = ParseBothWays(Copied(c.wire, max_slice, 4), &parsed, &tensors);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.says;
      EXPECT_THAT(std::string(s.message()), testing::HasSubstr(c.says));
    }
  }
}

// Random damage to valid requests (bytes flipped, cut out or inserted) and
// plain garbage, in random slices: the two parses agree on every input.
TEST(InPlaceParseTest, DamagedRequestsParseOrFailAsByTheCopyingParse) {
  std::mt19937 rng(12);
  const std::string prefill = RandomPrefill(1024, 512, 13).SerializeAsString();
  v1::WriteKVRequest kv;
  kv.add_slots(1);
  kv.mutable_k()->set_data(RandomBytes(256, 14));
  kv.mutable_k()->add_shape(1);
  kv.mutable_v()->set_data(RandomBytes(256, 15));
  const std::string write_kv = kv.SerializeAsString();
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string wire = iter % 2 == 0 ? prefill : write_kv;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits && !wire.empty(); ++e) {
      const size_t at = rng() % wire.size();
      switch (rng() % 3) {
        case 0: wire[at] = static_cast<char>(rng()); break;
        case 1: wire.erase(at, 1 + rng() % 8); break;
        default: wire.insert(at, RandomBytes(1 + rng() % 4, rng())); break;
      }
    }
    if (iter % 10 == 9) wire = RandomBytes(rng() % 200, rng());
    const grpc::ByteBuffer bytes = Copied(wire, 1 + rng() % 64, rng());
    InPlaceTensors tensors;
    if (iter % 2 == 0) {
      v1::PrefillRequest parsed;
      accepted += ParseBothWays(bytes, &parsed, &tensors).ok();
    } else {
      v1::WriteKVRequest parsed;
      accepted += ParseBothWays(bytes, &parsed, &tensors).ok();
    }
  }
  // Damage to the tensors' data leaves a request valid: both outcomes occur.
  EXPECT_GT(accepted, 100);
  EXPECT_LT(accepted, 2900);
}

// The metrics label of a Prefill is read before the request is validated:
// any qo_indptr, its differences taken in 64 bits (INT32_MAX - INT32_MIN
// overflowed int32 before, undefined behaviour, read as a decode).
TEST(PrefillShapeTest, AnyQoIndptrIsLabelledWithoutOverflow) {
  v1::PrefillRequest r;
  EXPECT_EQ(PrefillShape(r), Metrics::Shape::kDecode);
  for (int32_t v : {0, 1, 10}) r.add_qo_indptr(v);  // a sequence of 9 rows: more than decode's 8
  EXPECT_EQ(PrefillShape(r), Metrics::Shape::kPrefill);
  r.clear_qo_indptr();
  for (int32_t v : {0, 8, 16}) r.add_qo_indptr(v);
  EXPECT_EQ(PrefillShape(r), Metrics::Shape::kDecode);
  r.clear_qo_indptr();
  r.add_qo_indptr(std::numeric_limits<int32_t>::min());
  r.add_qo_indptr(std::numeric_limits<int32_t>::max());
  EXPECT_EQ(PrefillShape(r), Metrics::Shape::kPrefill);
  r.clear_qo_indptr();
  r.add_qo_indptr(std::numeric_limits<int32_t>::max());
  r.add_qo_indptr(std::numeric_limits<int32_t>::min());
  EXPECT_EQ(PrefillShape(r), Metrics::Shape::kDecode);
}

}  // namespace
}  // namespace attnserve
