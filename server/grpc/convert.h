// Proto <-> core struct conversion for the gRPC edge. No tensor bytes are
// copied: the core structs view the request message, which must outlive
// them. Used by the service handlers and by the fuzz targets.
#pragma once

#include "attnserve/v1/attention.pb.h"
#include "server/core/requests.h"

namespace attnserve {

// Each fills every request field of `call`; the caller sets tenant,
// deadline and cancellation. Output pointers go to `response`.
void ToCall(const v1::PrefillRequest& request, v1::PrefillResponse* response, PrefillCall* call);
void ToCall(const v1::WriteKVRequest& request, WriteKvCall* call);
void ToCall(const v1::ReadKVRequest& request, v1::ReadKVResponse* response, ReadKvCall* call);
void ToCall(const v1::MergeStatesRequest& request, v1::MergeStatesResponse* response,
            MergeStatesCall* call);

// Clears a Prefill request/response pair for the next call (MessagePool) but
// keeps the response's output and lse tensors, and so their data capacity:
// Clear() on the response would delete them. Returns the bytes kept.
int64_t ResetForReuse(v1::PrefillRequest* request, v1::PrefillResponse* response);

// Sets dtype and shape of an output tensor (its bytes are already there).
void SetTensorHeader(v1::Tensor* t, v1::DType dtype, absl::Span<const int64_t> shape);

}  // namespace attnserve
