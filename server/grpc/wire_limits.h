// Wire limits: what a request may hold, checked on its wire bytes before
// protobuf parses them (docs/security.md, "What hostile input costs").
//
// Parsing is where a hostile message costs memory: protobuf reserves what a
// length prefix claims before finding out the bytes are not there, a packed
// repeated int64 costs 8 bytes of memory per byte on the wire, and every
// element of a repeated message field is a heap object of a hundred bytes or
// more. CheckWire walks the bytes once, allocating nothing, and rejects a
// message in which
//  - a length-delimited field, at any depth, claims more bytes than follow;
//  - a repeated field (packed or not, summed over its occurrences) holds more
//    entries than its bound;
//  - a singular message field occurs more than once (protobuf would merge
//    the occurrences, concatenating their repeated fields);
//  - a group or a malformed tag appears;
//  - fields not listed (singular scalars, strings and bytes, and fields the
//    server does not know) occur more than 64 times in one message.
// What passes parses into at most its own size plus arrays whose lengths the
// server would accept anyway.
//
//   const WireMessage tensor{"Tensor", {{2, "shape", WireField::kRepeatedScalar, 8, nullptr,
//                                        "rank"}}};
//   absl::Status s = CheckWire(bytes, tensor);  // INVALID_ARGUMENT naming the field
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnserve {

struct WireMessage;

struct WireField {
  // kRepeatedFixed32: a repeated float or fixed32, packed (4 bytes an entry)
  // or not.
  enum Kind { kRepeatedScalar, kRepeatedFixed32, kMessage, kRepeatedMessage };
  uint32_t number = 0;
  const char* name = "";
  Kind kind = kRepeatedScalar;
  int64_t max_count = 0;                 // entries of a repeated field
  const WireMessage* message = nullptr;  // kMessage and kRepeatedMessage
  const char* bound = "";                // what max_count is, for errors ("max_request_rows")
};

// Fields not listed are only checked for well-formed lengths.
struct WireMessage {
  const char* name = "";  // full proto name, for errors
  std::vector<WireField> fields;
};

// OK, or INVALID_ARGUMENT naming the message, the field path and the bound.
absl::Status CheckWire(const grpc::ByteBuffer& bytes, const WireMessage& message);

// The limits of every attnserve.v1 request, from the server's bounds.
struct RequestWireLimits {
  // max_rows: query or KV rows one request may carry (and so sequences);
  // max_kv_indices: page ids one Prefill may name; num_pages: the pool's
  // pages; max_merge_states: states one MergeStates may merge; num_qo_heads:
  // sinks one AttentionOptions may hold; num_layers: a plan's layer_options;
  // num_kv_heads: scales one layer's k_scale or v_scale may hold (-1: as
  // num_qo_heads).
  RequestWireLimits(int64_t max_rows, int64_t max_kv_indices, int64_t num_pages,
                    int64_t max_merge_states, int64_t num_qo_heads = 1024,
                    int64_t num_layers = 1024, int64_t num_kv_heads = -1);
  RequestWireLimits(const RequestWireLimits&) = delete;  // the messages point at each other
  RequestWireLimits& operator=(const RequestWireLimits&) = delete;

  WireMessage region_ref;
  WireMessage tensor;
  WireMessage attention_options;
  WireMessage layer_options_entry;
  WireMessage attention_state;
  WireMessage get_server_info;
  WireMessage allocate_pages;
  WireMessage free_pages;
  WireMessage write_kv;
  WireMessage read_kv;
  WireMessage prefill;
  WireMessage merge_states;
  WireMessage create_plan;
  WireMessage release_plan;
  WireMessage system_region;
  WireMessage cuda_region;
  WireMessage register_region;
  WireMessage unregister_region;
  WireMessage list_regions;
  WireMessage open_channel;
  WireMessage close_channel;
  WireMessage grant_lease;
  WireMessage keep_alive;
  WireMessage revoke_lease;
  WireMessage list_holdings;
  WireMessage release_holdings;
  WireMessage layer_kv_scales;
  WireMessage set_kv_scales;
  WireMessage get_kv_scales;
};

}  // namespace attnserve
