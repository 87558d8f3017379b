#include "server/grpc/wire_limits.h"

#include <array>
#include <climits>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "server/core/status_macros.h"

namespace attnserve {
namespace {

using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;

constexpr size_t kMaxFields = 16;  // fields with limits in one message
constexpr int kMaxDepth = 8;       // nesting of listed message fields
// Occurrences of fields without limits (WireMessage lists every repeated
// and message field of attnserve.v1, wire_limits_test checks it: the rest
// are singular scalars, strings and bytes, each once in a message an
// encoder writes) in one message. Past it, a request is unknown fields in
// bulk: protobuf keeps each as a heap entry of 16 bytes or more (48 for an
// empty string), against 2 bytes on the wire.
constexpr int64_t kMaxUnlisted = 64;

// The path of the field being read, kept on the stack for error messages.
struct Frame {
  const Frame* parent;
  const char* field;  // null for the top level
  int64_t index;      // occurrence of a repeated message field, else -1
};

std::string PathOf(const Frame* frame) {
  if (frame == nullptr || frame->field == nullptr) return "";
  std::string parent = PathOf(frame->parent);
  std::string self = frame->index >= 0 ? absl::StrCat(frame->field, "[", frame->index, "]")
                                       : std::string(frame->field);
  return parent.empty() ? self : absl::StrCat(parent, ".", self);
}

std::string FieldPath(const Frame* frame, const char* field) {
  const std::string parent = PathOf(frame);
  return parent.empty() ? std::string(field) : absl::StrCat(parent, ".", field);
}

// Varints in the next `length` bytes (elements of a packed field), stopping
// once more than `limit` are seen. False when the bytes are not there.
bool CountVarints(CodedInputStream* input, uint32_t length, int64_t limit, int64_t* count) {
  while (length > 0) {
    const void* data = nullptr;
    int size = 0;
    if (!input->GetDirectBufferPointer(&data, &size) || size <= 0) return false;
    const uint32_t take = std::min<uint32_t>(length, static_cast<uint32_t>(size));
    const auto* p = static_cast<const uint8_t*>(data);
    for (uint32_t i = 0; i < take; ++i) *count += (p[i] & 0x80) == 0;
    if (!input->Skip(static_cast<int>(take))) return false;
    length -= take;
    if (*count > limit) return true;  // the caller reports it; the rest need not be read
  }
  return true;
}

// The wire types protobuf parses as an occurrence of `field` (any other it
// keeps as an unknown field).
bool Takes(const WireField& field, WireFormatLite::WireType wire) {
  if (wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) return true;  // a message, or packed
  switch (field.kind) {
    case WireField::kRepeatedScalar:
      return wire == WireFormatLite::WIRETYPE_VARINT;
    case WireField::kRepeatedFixed32:
      return wire == WireFormatLite::WIRETYPE_FIXED32;
    case WireField::kMessage:
    case WireField::kRepeatedMessage:
      return false;
  }
  return false;
}

class Walker {
 public:
  Walker(CodedInputStream* input, const WireMessage& top) : input_(input), top_(top) {}

  absl::Status Run() {
    const Frame root{nullptr, nullptr, -1};
    return Walk(top_, &root, 0);
  }

 private:
  absl::Status Malformed(const Frame* frame, const std::string& what) const {
    const std::string path = PathOf(frame);
    return absl::InvalidArgumentError(absl::StrCat("request does not parse as ", top_.name,
                                                   path.empty() ? "" : " at ", path, ": ", what));
  }

  absl::Status TooMany(const Frame* frame, const WireField& f) const {
    return absl::InvalidArgumentError(
        absl::StrCat(FieldPath(frame, f.name), " has more than ", f.max_count, " entries (",
                     f.bound, "=", f.max_count, ")"));
  }

  // Reads fields until the current limit (the message's end).
  absl::Status Walk(const WireMessage& message, const Frame* frame, int depth) {
    std::array<int64_t, kMaxFields> counts{};
    int64_t unlisted = 0;
    for (;;) {
      const uint32_t tag = input_->ReadTag();
      if (tag == 0) {  // the end of the message, or a malformed tag before it
        if (input_->BytesUntilLimit() == 0) return absl::OkStatus();
        return Malformed(frame, "malformed field tag");
      }
      const uint32_t number = WireFormatLite::GetTagFieldNumber(tag);
      size_t index = 0;
      while (index < message.fields.size() && message.fields[index].number != number) ++index;
      const WireField* field = index < message.fields.size() ? &message.fields[index] : nullptr;
      const WireFormatLite::WireType wire = WireFormatLite::GetTagWireType(tag);
      // A listed field in a wire type its kind does not take (a message sent
      // as a varint) is one protobuf keeps as an unknown field on the heap:
      // counted as one, or a flood of two-byte tags would each cost a heap
      // entry.
      if (field != nullptr && !Takes(*field, wire)) field = nullptr;
      if (field == nullptr && ++unlisted > kMaxUnlisted) {
        return Malformed(frame, absl::StrCat("more than ", kMaxUnlisted,
                                             " occurrences of singular or unknown fields (field ", number,
                                             " the last): fields this server does not know, a "
                                             "singular field repeated, or a field in a wire type "
                                             "that is not its own"));
      }
      switch (wire) {
        case WireFormatLite::WIRETYPE_VARINT: {
          uint64_t value = 0;
          if (!input_->ReadVarint64(&value)) return Malformed(frame, "truncated varint");
          if (field != nullptr && field->kind == WireField::kRepeatedScalar &&
              ++counts[index] > field->max_count) {
            return TooMany(frame, *field);
          }
          break;
        }
        case WireFormatLite::WIRETYPE_FIXED64:
          if (!input_->Skip(8)) return Malformed(frame, "truncated fixed64 field");
          break;
        case WireFormatLite::WIRETYPE_FIXED32:
          if (!input_->Skip(4)) return Malformed(frame, "truncated fixed32 field");
          if (field != nullptr && field->kind == WireField::kRepeatedFixed32 &&
              ++counts[index] > field->max_count) {
            return TooMany(frame, *field);
          }
          break;
        case WireFormatLite::WIRETYPE_LENGTH_DELIMITED: {
          uint32_t length = 0;
          if (!input_->ReadVarint32(&length)) return Malformed(frame, "truncated length");
          if (static_cast<int64_t>(length) > input_->BytesUntilLimit() &&
              input_->BytesUntilLimit() >= 0) {
            return Malformed(frame, absl::StrCat("field ", number, " claims ", length,
                                                 " bytes, only ", input_->BytesUntilLimit(),
                                                 " follow"));
          }
          if (field == nullptr) {
            if (!input_->Skip(static_cast<int>(length))) {
              return Malformed(frame, absl::StrCat("field ", number, " claims ", length,
                                                   " bytes that are not there"));
            }
            break;
          }
          ATTN_RETURN_IF_ERROR(Nested(*field, &counts[index], length, frame, depth));
          break;
        }
        default:
          return Malformed(frame, absl::StrCat("field ", number, " uses an unsupported wire type"));
      }
    }
  }

  // A length-delimited occurrence of a listed field.
  absl::Status Nested(const WireField& field, int64_t* count, uint32_t length, const Frame* frame,
                      int depth) {
    switch (field.kind) {
      case WireField::kRepeatedScalar: {  // packed: each element takes at least one byte
        // Within the bound by its length alone: skipped unread. Otherwise its
        // varints are counted. (Summed over occurrences, a length stands for
        // its count; only a split packed field, which no encoder writes, can
        // be refused while just under the bound.)
        if (length <= field.max_count - *count) {
          *count += length;
          if (!input_->Skip(static_cast<int>(length))) {
            return Malformed(frame, absl::StrCat(field.name, " is truncated"));
          }
          return absl::OkStatus();
        }
        int64_t exact = 0;
        if (!CountVarints(input_, length, field.max_count - *count, &exact)) {
          return Malformed(frame, absl::StrCat(field.name, " is truncated"));
        }
        *count += exact;
        if (*count > field.max_count) return TooMany(frame, field);
        return absl::OkStatus();
      }
      case WireField::kRepeatedFixed32: {  // packed: 4 bytes an entry
        *count += (int64_t{length} + 3) / 4;
        if (*count > field.max_count) return TooMany(frame, field);
        if (!input_->Skip(static_cast<int>(length))) {
          return Malformed(frame, absl::StrCat(field.name, " is truncated"));
        }
        return absl::OkStatus();
      }
      case WireField::kMessage:
      case WireField::kRepeatedMessage: {
        if (field.kind == WireField::kMessage && *count >= 1) {
          return Malformed(frame, absl::StrCat(field.name, " appears more than once"));
        }
        const int64_t occurrence = (*count)++;
        if (field.kind == WireField::kRepeatedMessage && *count > field.max_count) {
          return TooMany(frame, field);
        }
        if (depth + 1 > kMaxDepth) return Malformed(frame, "nested too deeply");
        const Frame child{frame, field.name,
                          field.kind == WireField::kRepeatedMessage ? occurrence : -1};
        const CodedInputStream::Limit limit = input_->PushLimit(static_cast<int>(length));
        absl::Status status = Walk(*field.message, &child, depth + 1);
        input_->PopLimit(limit);
        return status;
      }
    }
    return absl::OkStatus();
  }

  CodedInputStream* const input_;
  const WireMessage& top_;
};

}  // namespace

absl::Status CheckWire(const grpc::ByteBuffer& bytes, const WireMessage& message) {
  if (bytes.Length() > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(message.name, " of ", bytes.Length(), " bytes: at most ", INT_MAX));
  }
  // The reader only reads; gRPC's API takes the buffer non-const.
  grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(&bytes));
  if (!reader.status().ok()) {
    return absl::InvalidArgumentError(absl::StrCat("request does not parse as ", message.name));
  }
  CodedInputStream input(&reader);
  input.PushLimit(static_cast<int>(bytes.Length()));
  return Walker(&input, message).Run();
}

RequestWireLimits::RequestWireLimits(int64_t max_rows, int64_t max_kv_indices, int64_t num_pages,
                                     int64_t max_merge_states, int64_t num_qo_heads,
                                     int64_t num_layers, int64_t num_kv_heads) {
  using F = WireField;
  if (num_kv_heads < 0) num_kv_heads = num_qo_heads;
  region_ref = {"attnserve.v1.RegionRef", {}};
  attention_options = {"attnserve.v1.AttentionOptions",
                       {{3, "sinks", F::kRepeatedFixed32, num_qo_heads, nullptr, "num_qo_heads"}}};
  layer_options_entry = {"attnserve.v1.CreatePlanRequest.LayerOptionsEntry",
                         {{2, "value", F::kMessage, 1, &attention_options, ""}}};
  tensor = {"attnserve.v1.Tensor",
            {{2, "shape", F::kRepeatedScalar, 8, nullptr, "rank"},
             {4, "region", F::kMessage, 1, &region_ref, ""}}};
  attention_state = {"attnserve.v1.AttentionState",
                     {{1, "v", F::kMessage, 1, &tensor, ""}, {2, "lse", F::kMessage, 1, &tensor, ""}}};
  get_server_info = {"attnserve.v1.GetServerInfoRequest", {}};
  allocate_pages = {"attnserve.v1.AllocatePagesRequest", {}};
  free_pages = {"attnserve.v1.FreePagesRequest",
                {{1, "page_ids", F::kRepeatedScalar, num_pages, nullptr, "num_pages"}}};
  write_kv = {"attnserve.v1.WriteKVRequest",
              {{2, "slots", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"},
               {3, "k", F::kMessage, 1, &tensor, ""},
               {4, "v", F::kMessage, 1, &tensor, ""}}};
  read_kv = {"attnserve.v1.ReadKVRequest",
             {{2, "slots", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"},
              {4, "k_region", F::kMessage, 1, &region_ref, ""},
              {5, "v_region", F::kMessage, 1, &region_ref, ""}}};
  prefill = {"attnserve.v1.PrefillRequest",
             {{2, "q", F::kMessage, 1, &tensor, ""},
              {3, "qo_indptr", F::kRepeatedScalar, max_rows + 1, nullptr, "max_request_rows + 1"},
              {4, "kv_indptr", F::kRepeatedScalar, max_rows + 1, nullptr, "max_request_rows + 1"},
              {5, "kv_indices", F::kRepeatedScalar, max_kv_indices, nullptr,
               "max_request_kv_indices"},
              {6, "kv_last_page_len", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"},
              {10, "append_slots", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"},
              {11, "append_k", F::kMessage, 1, &tensor, ""},
              {12, "append_v", F::kMessage, 1, &tensor, ""},
              {15, "output_region", F::kMessage, 1, &region_ref, ""},
              {16, "lse_region", F::kMessage, 1, &region_ref, ""},
              {17, "kv_keys_after", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"},
              {19, "options", F::kMessage, 1, &attention_options, ""},
              {20, "apply_sinks", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"}}};
  create_plan = {"attnserve.v1.CreatePlanRequest",
                 {{1, "qo_indptr", F::kRepeatedScalar, max_rows + 1, nullptr, "max_request_rows + 1"},
                  {2, "kv_indptr", F::kRepeatedScalar, max_rows + 1, nullptr, "max_request_rows + 1"},
                  {3, "kv_indices", F::kRepeatedScalar, max_kv_indices, nullptr,
                   "max_request_kv_indices"},
                  {4, "kv_last_page_len", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"},
                  {5, "append_slots", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"},
                  {7, "kv_keys_after", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"},
                  {9, "options", F::kMessage, 1, &attention_options, ""},
                  {10, "layer_options", F::kRepeatedMessage, num_layers, &layer_options_entry,
                   "num_layers"},
                  {11, "apply_sinks", F::kRepeatedScalar, max_rows, nullptr, "max_request_rows"}}};
  release_plan = {"attnserve.v1.ReleasePlanRequest", {}};
  merge_states = {"attnserve.v1.MergeStatesRequest",
                  {{1, "states", F::kRepeatedMessage, max_merge_states, &attention_state,
                    "max_merge_states"},
                   {3, "v_region", F::kMessage, 1, &region_ref, ""},
                   {4, "lse_region", F::kMessage, 1, &region_ref, ""}}};
  system_region = {"attnserve.v1.SystemRegion", {}};
  cuda_region = {"attnserve.v1.CudaRegion", {}};
  register_region = {"attnserve.v1.RegisterRegionRequest",
                     {{2, "system", F::kMessage, 1, &system_region, ""},
                      {3, "cuda", F::kMessage, 1, &cuda_region, ""}}};
  unregister_region = {"attnserve.v1.UnregisterRegionRequest", {}};
  list_regions = {"attnserve.v1.ListRegionsRequest", {}};
  open_channel = {"attnserve.v1.OpenChannelRequest",
                  {{1, "ring", F::kMessage, 1, &region_ref, ""}}};
  close_channel = {"attnserve.v1.CloseChannelRequest", {}};
  grant_lease = {"attnserve.v1.GrantLeaseRequest", {}};
  keep_alive = {"attnserve.v1.KeepAliveRequest", {}};
  revoke_lease = {"attnserve.v1.RevokeLeaseRequest", {}};
  list_holdings = {"attnserve.v1.ListHoldingsRequest", {}};
  release_holdings = {"attnserve.v1.ReleaseHoldingsRequest", {}};
  // Scales per KV head: at most num_kv_heads (validation checks the count:
  // 1 or num_kv_heads).
  layer_kv_scales = {"attnserve.v1.LayerKvScales",
                     {{2, "k_scale", F::kRepeatedFixed32, num_kv_heads, nullptr, "num_kv_heads"},
                      {3, "v_scale", F::kRepeatedFixed32, num_kv_heads, nullptr, "num_kv_heads"}}};
  set_kv_scales = {"attnserve.v1.SetKvScalesRequest",
                   {{1, "layers", F::kRepeatedMessage, num_layers, &layer_kv_scales, "num_layers"}}};
  get_kv_scales = {"attnserve.v1.GetKvScalesRequest", {}};
}

}  // namespace attnserve
