// libFuzzer target for the edge's wire limits (server/grpc/wire_limits.h):
// every input is checked and parsed as each attnserve.v1 request, exactly as
// the handlers do. It aborts when
//  - a request passes the limits but its parsed repeated fields hold more
//    entries than the limits allow (the walker miscounted), or
//  - ParseInto accepts bytes that protobuf's own parser rejects, or parses
//    them into a different message, or
//  - the in-place parse of Prefill and WriteKV (their tensors' data viewed in
//    the slices) accepts or rejects other bytes than ParseInto, or gives a
//    different message once the viewed data is put back. The input is also
//    cut into slices of 1 to 16 bytes there, as gRPC may hand it over.
// Every input is also read as a request channel's ring header
// (ReadChannelHeader, server/core/channel_table.h): it aborts when a header
// passes whose geometry is out of bounds or larger than the input.
// Cheap per input, so a nightly run reaches 10^7 executions in minutes.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "common/channel_layout.h"
#include "server/core/channel_table.h"
#include "server/grpc/convert.h"
#include "server/grpc/wire_limits.h"

namespace attnserve {
namespace {

// Small bounds, so that inputs of a few KiB can cross them.
constexpr int64_t kRows = 64, kIndices = 256, kPages = 32, kStates = 4;

const RequestWireLimits& Limits() {
  static const RequestWireLimits* limits = new RequestWireLimits(kRows, kIndices, kPages, kStates);
  return *limits;
}

void Require(bool condition) {
  if (!condition) std::abort();
}

void CheckTensor(const v1::Tensor& t) { Require(t.shape_size() <= 8); }

template <typename M>
bool ParseBoth(const grpc::ByteBuffer& bytes, const uint8_t* data, size_t size,
               const WireMessage& limits, M* parsed) {
  if (!ParseInto(bytes, limits, parsed).ok()) return false;
  M reference;
  Require(reference.ParseFromArray(data, static_cast<int>(size)));
  Require(reference.SerializeAsString() == parsed->SerializeAsString());
  return true;
}

std::string Bytes(const TensorView& v) {
  if (v.scattered.empty()) return std::string(v.data);
  std::string out(static_cast<size_t>(v.scattered.size), '\0');
  CopyOut(v.scattered, 0, v.scattered.size, out.data());
  return out;
}

// The in-place parse against ParseInto, on `bytes` and on the same bytes in
// small slices.
template <typename M>
void ParseInPlace(const grpc::ByteBuffer& bytes, const uint8_t* data, size_t size,
                  const WireMessage& limits, absl::Span<const uint32_t> in_place,
                  v1::Tensor* (*tensor)(M*, uint32_t)) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < size;) {
    const size_t n = std::min<size_t>(size - at, 1 + data[at] % 16);
    slices.emplace_back(data + at, n);
    at += n;
  }
  const grpc::ByteBuffer sliced(slices.data(), slices.size());
  for (const grpc::ByteBuffer* b : {&bytes, &sliced}) {
    // Against ParseInto of the same slices: where a malformed varint is
    // reported (which field's path) can depend on where slices end.
    M copied;
    const absl::Status copied_status = ParseInto(*b, limits, &copied);
    M parsed;
    InPlaceTensors tensors;
    const absl::Status status = ParseInto(*b, limits, in_place, &parsed, &tensors);
    Require(status == copied_status);
    if (!status.ok()) continue;
    for (uint32_t field : in_place) {
      TensorView view;
      if (!tensors.View(field, &view)) continue;
      Require(tensor(&parsed, field)->data().empty());
      tensor(&parsed, field)->set_data(Bytes(view));
    }
    Require(parsed.SerializeAsString() == copied.SerializeAsString());
  }
}

v1::Tensor* PrefillTensor(v1::PrefillRequest* r, uint32_t field) {
  return field == 2 ? r->mutable_q() : field == 11 ? r->mutable_append_k() : r->mutable_append_v();
}
v1::Tensor* WriteKvTensor(v1::WriteKVRequest* r, uint32_t field) {
  return field == 3 ? r->mutable_k() : r->mutable_v();
}

}  // namespace
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  if (size > (1 << 20)) return 0;
  grpc::Slice slice(data, size);
  const grpc::ByteBuffer bytes(&slice, 1);
  const RequestWireLimits& l = Limits();
  if (v1::PrefillRequest r; ParseBoth(bytes, data, size, l.prefill, &r)) {
    Require(r.qo_indptr_size() <= kRows + 1 && r.kv_indptr_size() <= kRows + 1);
    Require(r.kv_indices_size() <= kIndices && r.kv_last_page_len_size() <= kRows);
    Require(r.append_slots_size() <= kRows && r.kv_keys_after_size() <= kRows);
    CheckTensor(r.q());
    CheckTensor(r.append_k());
    CheckTensor(r.append_v());
  }
  ParseInPlace<v1::PrefillRequest>(bytes, data, size, l.prefill, kPrefillInPlace, PrefillTensor);
  ParseInPlace<v1::WriteKVRequest>(bytes, data, size, l.write_kv, kWriteKvInPlace, WriteKvTensor);
  if (v1::WriteKVRequest r; ParseBoth(bytes, data, size, l.write_kv, &r)) {
    Require(r.slots_size() <= kRows);
    CheckTensor(r.k());
    CheckTensor(r.v());
  }
  if (v1::ReadKVRequest r; ParseBoth(bytes, data, size, l.read_kv, &r)) {
    Require(r.slots_size() <= kRows);
  }
  if (v1::FreePagesRequest r; ParseBoth(bytes, data, size, l.free_pages, &r)) {
    Require(r.page_ids_size() <= kPages);
  }
  if (v1::MergeStatesRequest r; ParseBoth(bytes, data, size, l.merge_states, &r)) {
    Require(r.states_size() <= kStates);
    for (const auto& s : r.states()) {
      CheckTensor(s.v());
      CheckTensor(s.lse());
    }
  }
  if (v1::AllocatePagesRequest r; ParseBoth(bytes, data, size, l.allocate_pages, &r)) {
  }
  if (v1::OpenChannelRequest r; ParseBoth(bytes, data, size, l.open_channel, &r)) {
  }
  if (v1::CloseChannelRequest r; ParseBoth(bytes, data, size, l.close_channel, &r)) {
  }
  // The input as a ring (its words aligned, as in a mapping).
  static std::vector<uint64_t> ring;
  ring.assign((size + 7) / 8, 0);
  if (size > 0) std::memcpy(ring.data(), data, size);  // data may be null when size is 0
  auto header = ReadChannelHeader(reinterpret_cast<const char*>(ring.data()),
                                  static_cast<int64_t>(size), "ring");
  if (header.ok()) {
    Require(header->slot_count >= 1 && header->slot_count <= 64);
    Require(header->slot_bytes >= 4096 && header->slot_bytes <= (16 << 20) &&
            header->slot_bytes % 64 == 0);
    Require(ChannelBytes(header->slot_count, header->slot_bytes) <= static_cast<int64_t>(size));
  }
  return 0;
}
