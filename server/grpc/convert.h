// Proto <-> core struct conversion for the gRPC edge. No tensor bytes are
// copied: the core structs view the request message, which must outlive
// them, and responses are sent from the buffers the backend filled. Used by
// the service handlers and by the fuzz targets.
//
// The inline tensors of Prefill (q, append_k, append_v) and WriteKV (k, v)
// are not even parsed into the message: their data stays in the slices gRPC
// received the request in, and the core views it there (one piece, or a
// ScatterList of several) until the backend copies it where it goes:
//
//   v1::PrefillRequest request;
//   InPlaceTensors tensors;  // outlives the call
//   ATTN_RETURN_IF_ERROR(ParseInto(bytes, limits.prefill, kPrefillInPlace, &request, &tensors));
//   ToCall(request, tensors, &call);
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attnserve/v1/attention.pb.h"
#include "absl/types/span.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "common/scatter_list.h"
#include "server/core/requests.h"
#include "server/core/validate.h"
#include "server/grpc/wire_limits.h"
#include "server/metrics.h"

namespace attnserve {

// The one mapping between the API's attnserve.v1.DType and the core's
// dtypes: a received tensor's declared dtype (any value a client may send),
// and the dtype of the tensors the server sends (the KV element type).
TensorDType FromProto(v1::DType dtype);
v1::DType ToProto(KvDType dtype);
v1::DType ToProto(TensorDType dtype);
// What a server's KV pools hold (ServerInfo.kv_dtype): the 16-bit dtype, or
// the FP8 format.
v1::DType KvDTypeProto(const KvGeometry& geo);

// The data of a request's tensor fields that ParseInto read in place: it
// holds references to the slices the request arrived in (so that they
// outlive the request's grpc::ByteBuffer, which may be cleared) and where
// each tensor's data lies in them. TensorViews made from it point into it:
// it must outlive the core's call.
class InPlaceTensors {
 public:
  InPlaceTensors() = default;
  InPlaceTensors(const InPlaceTensors&) = delete;  // views point into it
  InPlaceTensors& operator=(const InPlaceTensors&) = delete;

  // When top-level Tensor field `field` was read in place, points
  // view->data (data in one slice) or view->scattered (several) at its data
  // and returns true; else false and `view` is unchanged.
  bool View(uint32_t field, TensorView* view) const;
  // Bytes of the slices held: the whole request's.
  int64_t held_bytes() const;
  void Clear();

 private:
  friend absl::Status ParseInto(const grpc::ByteBuffer& bytes, const WireMessage& limits,
                                absl::Span<const uint32_t> in_place,
                                google::protobuf::MessageLite* request, InPlaceTensors* tensors);

  struct Field {
    uint32_t number = 0;
    size_t first_piece = 0;  // in pieces_
    size_t num_pieces = 0;
    int64_t bytes = 0;
  };
  // Small slices keep their bytes inside the grpc_slice itself: the pieces
  // point into this vector's elements, which therefore never move once
  // filled.
  std::vector<grpc::Slice> slices_;
  std::vector<Field> fields_;
  std::vector<ScatterPiece> pieces_;
};

// The Tensor fields of Prefill (q, append_k, append_v) and WriteKV (k, v)
// whose data the edge reads in place.
inline constexpr uint32_t kPrefillInPlace[] = {v1::PrefillRequest::kQFieldNumber,
                                               v1::PrefillRequest::kAppendKFieldNumber,
                                               v1::PrefillRequest::kAppendVFieldNumber};
inline constexpr uint32_t kWriteKvInPlace[] = {v1::WriteKVRequest::kKFieldNumber,
                                               v1::WriteKVRequest::kVFieldNumber};

// Each fills every request field of `call` but the CallContext (tenant,
// deadline, cancellation, request id, expected incarnation), which the
// handler sets. Output pointers go to `response`. Tensors read in place
// (`tensors`) are viewed there, the others in the message.
// Prefill's outputs go to call->out, which the caller sets.
void ToCall(const v1::PrefillRequest& request, const InPlaceTensors& tensors, PrefillCall* call);
void ToCall(const v1::PrefillRequest& request, PrefillCall* call);  // no tensor in place
// The metrics' `shape` label of a Prefill: kDecode when every sequence has
// at most 8 query rows (the speculative-decoding range), else kPrefill.
// PrefillShape reads the request's own layout; a request naming a plan has
// none, and is kPrefill until the core has found the plan and reported its
// largest sequence (PrefillOutput::max_seq_q_rows, ShapeOfRows).
Metrics::Shape PrefillShape(const v1::PrefillRequest& request);
Metrics::Shape ShapeOfRows(int64_t max_seq_q_rows);
// A CreatePlan's layout, viewing the request's arrays.
PrefillLayout ToLayout(const v1::CreatePlanRequest& request);
// A CreatePlan's attention options, viewing the request.
PlanOptionsView ToPlanOptions(const v1::CreatePlanRequest& request);
void ToCall(const v1::WriteKVRequest& request, const InPlaceTensors& tensors, WriteKvCall* call);
void ToCall(const v1::WriteKVRequest& request, WriteKvCall* call);
void ToCall(const v1::ReadKVRequest& request, v1::ReadKVResponse* response, ReadKvCall* call);
void ToCall(const v1::MergeStatesRequest& request, v1::MergeStatesResponse* response,
            MergeStatesCall* call);
// The layers' scales, viewing the request (the CallContext left unset).
SetKvScalesCall ToCall(const v1::SetKvScalesRequest& request);

// An OpenChannel's ring (unset when the request names none: the core then
// finds no region of that name).
RegionRefView ToRingRef(const v1::OpenChannelRequest& request);

// A RegisterRegion's spec (a request with neither kind set is a system
// region with an empty claim token, which the core rejects naming
// system.claim_token).
RegionSpec ToSpec(const v1::RegisterRegionRequest& request);
void ToProto(const RegionInfoData& info, v1::RegionInfo* out);

// Clears a Prefill request for the next call (RecyclingPool) but keeps its
// q, append_k and append_v tensors, and so their data capacity (Clear() on
// the request would delete them; read in place, their data stays empty).
// Returns the bytes of capacity kept.
int64_t ResetForReuse(v1::PrefillRequest* request);

// Parses a request's wire bytes into `request`, which must be clear (fresh or
// ResetForReuse): strings and repeated fields it still holds are refilled in
// place, so their buffers are reused. The bytes are first checked against
// `limits` (wire_limits.h), so that no claim in them costs memory that was
// not sent. INVALID_ARGUMENT naming the field when they do not fit or parse.
absl::Status ParseInto(const grpc::ByteBuffer& bytes, const WireMessage& limits,
                       google::protobuf::MessageLite* request);

// The same, but the data of the top-level Tensor fields `in_place`
// (kPrefillInPlace, kWriteKvInPlace) is not copied: *tensors (cleared
// first) gets references to the request's slices and where each of those
// tensors' data lies in them; the message's tensors get their dtype, shape
// and region, and no data. Every other byte, those tensors' other fields
// included, is parsed by protobuf as ParseInto does, after the same wire
// limits; the same INVALID_ARGUMENT when the bytes do not fit or parse.
absl::Status ParseInto(const grpc::ByteBuffer& bytes, const WireMessage& limits,
                       absl::Span<const uint32_t> in_place, google::protobuf::MessageLite* request,
                       InPlaceTensors* tensors);

// The wire bytes of an attnserve.v1.PrefillResponse whose output and lse
// data are out's buffer, shaped as out says: the slices point into it and
// keep it alive until gRPC has sent them (no copy). The bytes equal what the
// generated code would serialize for the same response.
grpc::ByteBuffer EncodePrefillResponse(PrefillOutput out, uint64_t incarnation);

// The wire bytes of a ReadKV or MergeStates response: its tensors' data are
// sent from the response's own strings (which the backend filled), not
// serialized into a copy; the response lives until gRPC has sent them. The
// bytes parse as the same message.
grpc::ByteBuffer EncodeTensorResponse(std::unique_ptr<v1::ReadKVResponse> response);
grpc::ByteBuffer EncodeTensorResponse(std::unique_ptr<v1::MergeStatesResponse> response);

// Sets dtype and shape of an output tensor (its bytes are already there).
void SetTensorHeader(v1::Tensor* t, v1::DType dtype, absl::Span<const int64_t> shape);

}  // namespace attnserve
