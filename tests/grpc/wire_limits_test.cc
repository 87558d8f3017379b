// The wire limits (server/grpc/wire_limits.h) against the protocol: every
// repeated and message field of every request the service takes is listed
// with a bound, so that what CheckWire leaves unlisted is singular fields
// and fields the server does not know; and those, past 64 occurrences in
// one message, are refused before protobuf keeps each as a heap entry.
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "server/grpc/wire_limits.h"

namespace attnserve {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::DescriptorPool;
using google::protobuf::FieldDescriptor;
using ::testing::HasSubstr;

std::vector<const WireMessage*> AllMessages(const RequestWireLimits& l) {
  return {&l.region_ref,        &l.tensor,          &l.attention_options, &l.layer_options_entry,
          &l.attention_state,   &l.get_server_info, &l.allocate_pages,    &l.free_pages,
          &l.write_kv,          &l.read_kv,         &l.prefill,           &l.merge_states,
          &l.create_plan,       &l.release_plan,    &l.system_region,     &l.cuda_region,
          &l.register_region,   &l.unregister_region, &l.list_regions,    &l.open_channel,
          &l.close_channel,     &l.grant_lease,     &l.keep_alive,        &l.revoke_lease,
          &l.list_holdings,     &l.release_holdings, &l.layer_kv_scales,  &l.set_kv_scales,
          &l.get_kv_scales};
}

grpc::ByteBuffer Buffer(const std::string& bytes) {
  grpc::Slice slice(bytes.data(), bytes.size());
  return grpc::ByteBuffer(&slice, 1);
}

// Each request type of the service, and each message type they contain,
// has a WireMessage, which lists every repeated or message field with the
// protocol's number.
TEST(WireLimitsTest, EveryRepeatedAndMessageFieldOfEveryRequestIsListed) {
  const RequestWireLimits limits(1000, 1000, 1000, 16);
  std::map<std::string, const WireMessage*> by_name;
  for (const WireMessage* m : AllMessages(limits)) by_name[m->name] = m;
  const DescriptorPool* pool = DescriptorPool::generated_pool();
  const auto* service = pool->FindServiceByName("attnserve.v1.AttentionService");
  ASSERT_NE(service, nullptr);
  std::vector<const Descriptor*> todo;
  for (int i = 0; i < service->method_count(); ++i) todo.push_back(service->method(i)->input_type());
  std::set<std::string> seen;
  while (!todo.empty()) {
    const Descriptor* d = todo.back();
    todo.pop_back();
    if (!seen.insert(d->full_name()).second) continue;
    auto it = by_name.find(d->full_name());
    ASSERT_NE(it, by_name.end()) << d->full_name() << " has no WireMessage";
    const WireMessage& wire = *it->second;
    for (int f = 0; f < d->field_count(); ++f) {
      const FieldDescriptor* field = d->field(f);
      const bool message = field->type() == FieldDescriptor::TYPE_MESSAGE;
      if (message) todo.push_back(field->message_type());
      if (!message && !field->is_repeated()) continue;
      const WireField* listed = nullptr;
      for (const WireField& w : wire.fields) {
        if (w.number == static_cast<uint32_t>(field->number())) listed = &w;
      }
      ASSERT_NE(listed, nullptr) << field->full_name() << " is repeated or a message but has no bound";
      EXPECT_EQ(listed->name, field->name()) << field->full_name();
      if (message) {
        EXPECT_EQ(listed->kind, field->is_repeated() ? WireField::kRepeatedMessage : WireField::kMessage)
            << field->full_name();
        ASSERT_NE(listed->message, nullptr) << field->full_name();
        EXPECT_EQ(listed->message->name, field->message_type()->full_name()) << field->full_name();
      } else {
        const bool four = field->type() == FieldDescriptor::TYPE_FLOAT ||
                          field->type() == FieldDescriptor::TYPE_FIXED32 ||
                          field->type() == FieldDescriptor::TYPE_SFIXED32;
        EXPECT_EQ(listed->kind, four ? WireField::kRepeatedFixed32 : WireField::kRepeatedScalar)
            << field->full_name();
      }
    }
  }
}

// A listed field in a wire type that is not its own (the q tensor, field 2
// of a Prefill, sent as a varint; kv_indices, field 5, as a fixed64) is one
// protobuf keeps as an unknown field: past 64 such occurrences the request
// is refused before parsing, not after a heap entry each.
TEST(WireLimitsTest, ListedFieldsInAnotherWireTypeCountAsUnknown) {
  const RequestWireLimits limits(1000, 1000, 1000, 16);
  auto repeated = [](const std::string& one, int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += one;
    return s;
  };
  const std::string q_as_varint("\x10\x00", 2);
  const std::string indices_as_fixed64 = std::string("\x29", 1) + std::string(8, '\0');
  for (const std::string& one : {q_as_varint, indices_as_fixed64}) {
    EXPECT_TRUE(CheckWire(Buffer(repeated(one, 64)), limits.prefill).ok());
    absl::Status s = CheckWire(Buffer(repeated(one, 65)), limits.prefill);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("a field in a wire type that is not its own"));
  }
  // Its own wire types still count as entries of the field, not as unknown.
  std::string indices;
  for (int i = 0; i < 100; ++i) indices += std::string("\x28\x01", 2);  // kv_indices as varints
  EXPECT_TRUE(CheckWire(Buffer(indices), limits.prefill).ok());
}

// 64 occurrences of unlisted fields in one message pass (a newer client's
// few fields, or singular fields); 65 are refused, at the top level and in
// a nested message, naming where.
TEST(WireLimitsTest, UnknownFieldsInBulkAreRefused) {
  const RequestWireLimits limits(1000, 1000, 1000, 16);
  auto unknown = [](int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s += (i % 2 == 0) ? std::string("\xf8\x07\x00", 3)   // field 127, varint 0
                                                  : std::string("\xfa\x07\x00", 3);  // field 127, empty bytes
    return s;
  };
  EXPECT_TRUE(CheckWire(Buffer(unknown(64)), limits.get_server_info).ok());
  absl::Status s = CheckWire(Buffer(unknown(65)), limits.get_server_info);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("more than 64 occurrences"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("field 127"));
  // In the q tensor of a Prefill: 2 = q, length-delimited.
  for (const int n : {64, 65}) {
    const std::string inner = unknown(n);
    std::string prefill = "\x12";
    prefill += static_cast<char>(0x80 | (inner.size() & 0x7f));
    prefill += static_cast<char>(inner.size() >> 7);
    prefill += inner;
    s = CheckWire(Buffer(prefill), limits.prefill);
    if (n == 64) {
      EXPECT_TRUE(s.ok()) << s;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("attnserve.v1.PrefillRequest at q:"));
    }
  }
  // A real request's singular fields are far from it.
  v1::PrefillRequest r;
  r.set_layer(3);
  r.set_plan_id(7);
  r.set_sm_scale(0.5f);
  r.set_causal(true);
  r.mutable_q()->set_dtype(v1::DTYPE_BF16);
  r.mutable_q()->set_data(std::string(64, 'x'));
  EXPECT_TRUE(CheckWire(Buffer(r.SerializeAsString()), limits.prefill).ok());
}

}  // namespace
}  // namespace attnserve
