// Proto <-> core struct conversion for the gRPC edge. No tensor bytes are
// copied: the core structs view the request message, which must outlive
// them, and responses are sent from the buffers the backend filled. Used by
// the service handlers and by the fuzz targets.
#pragma once

#include <cstdint>
#include <memory>

#include "attnserve/v1/attention.pb.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/core/requests.h"
#include "server/core/validate.h"
#include "server/grpc/wire_limits.h"

namespace attnserve {

// The one mapping between the API's attnserve.v1.DType and the core's
// dtypes: a received tensor's declared dtype (any value a client may send),
// and the dtype of the tensors the server sends (the KV element type).
TensorDType FromProto(v1::DType dtype);
v1::DType ToProto(KvDType dtype);

// Each fills every request field of `call` but the CallContext (tenant,
// deadline, cancellation, request id, expected incarnation), which the
// handler sets. Output pointers go to `response`.
// Prefill's outputs go to call->out, which the caller sets.
void ToCall(const v1::PrefillRequest& request, PrefillCall* call);
// A CreatePlan's layout, viewing the request's arrays.
PrefillLayout ToLayout(const v1::CreatePlanRequest& request);
void ToCall(const v1::WriteKVRequest& request, WriteKvCall* call);
void ToCall(const v1::ReadKVRequest& request, v1::ReadKVResponse* response, ReadKvCall* call);
void ToCall(const v1::MergeStatesRequest& request, v1::MergeStatesResponse* response,
            MergeStatesCall* call);

// A RegisterRegion's spec (a request with neither kind set is a system
// region with an empty key, which the core rejects naming system.key).
RegionSpec ToSpec(const v1::RegisterRegionRequest& request);
void ToProto(const RegionInfoData& info, v1::RegionInfo* out);

// Clears a Prefill request for the next call (RecyclingPool) but keeps its
// q, append_k and append_v tensors, and so their data capacity (Clear() on
// the request would delete them). Returns the bytes of capacity kept.
int64_t ResetForReuse(v1::PrefillRequest* request);

// Parses a request's wire bytes into `request`, which must be clear (fresh or
// ResetForReuse): strings and repeated fields it still holds are refilled in
// place, so their buffers are reused. The bytes are first checked against
// `limits` (wire_limits.h), so that no claim in them costs memory that was
// not sent. INVALID_ARGUMENT naming the field when they do not fit or parse.
absl::Status ParseInto(const grpc::ByteBuffer& bytes, const WireMessage& limits,
                       google::protobuf::MessageLite* request);

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
