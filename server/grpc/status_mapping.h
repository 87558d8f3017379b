// The one place where absl::Status becomes grpc::Status, and the gRPC code
// names of the metrics' `code` label.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace attnserve {

grpc::Status ToGrpcStatus(const absl::Status& status);

// gRPC code name as used in metric labels: "OK", "INVALID_ARGUMENT", ...
const char* GrpcCodeName(grpc::StatusCode code);

}  // namespace attnserve
