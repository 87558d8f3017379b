// ToGrpcStatus: every absl code maps to the gRPC code of the same meaning
// and keeps its message; GrpcCodeName gives the metric label.
#include "server/grpc/status_mapping.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

const std::vector<std::pair<absl::StatusCode, grpc::StatusCode>>& AllCodes() {
  static const auto* codes = new std::vector<std::pair<absl::StatusCode, grpc::StatusCode>>{
      {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
      {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
      {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
      {absl::StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
      {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
      {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
      {absl::StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
      {absl::StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
      {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED},
      {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
      {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
      {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL},
      {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
      {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
      {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
  };
  return *codes;
}

TEST(StatusMappingTest, OkIsOk) {
  grpc::Status s = ToGrpcStatus(absl::OkStatus());
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OK);
  EXPECT_EQ(s.error_message(), "");
}

TEST(StatusMappingTest, EveryCodeMapsToItsGrpcTwinAndKeepsTheMessage) {
  for (const auto& [absl_code, grpc_code] : AllCodes()) {
    const std::string message = "field q.shape[1]=7 must be 32 (" +
                                absl::StatusCodeToString(absl_code) + ")";
    grpc::Status s = ToGrpcStatus(absl::Status(absl_code, message));
    EXPECT_EQ(s.error_code(), grpc_code) << absl::StatusCodeToString(absl_code);
    EXPECT_EQ(s.error_message(), message) << absl::StatusCodeToString(absl_code);
    EXPECT_FALSE(s.ok());
  }
}

TEST(StatusMappingTest, EveryCodeWithTheSameNumberAsInGrpc) {
  // Both follow google.rpc.Code: the numbers agree, so a client converting
  // back (Client::FromGrpc) gets the server's absl code.
  for (const auto& [absl_code, grpc_code] : AllCodes()) {
    EXPECT_EQ(static_cast<int>(ToGrpcStatus(absl::Status(absl_code, "x")).error_code()),
              static_cast<int>(absl_code));
  }
}

TEST(StatusMappingTest, UnknownAbslCodeBecomesUnknown) {
  grpc::Status s = ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(99), "odd"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(s.error_message(), "odd");
}

TEST(StatusMappingTest, MessageWithBinaryAndLongTextIsKeptWhole) {
  std::string message(10000, 'a');
  message[17] = '\0';
  message += "\xe2\x82\xac end";
  grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError(message));
  EXPECT_EQ(s.error_message(), message);
}

TEST(StatusMappingTest, CodeNamesAreTheGrpcNames) {
  const std::vector<std::pair<grpc::StatusCode, std::string>> names = {
      {grpc::StatusCode::OK, "OK"},
      {grpc::StatusCode::CANCELLED, "CANCELLED"},
      {grpc::StatusCode::UNKNOWN, "UNKNOWN"},
      {grpc::StatusCode::INVALID_ARGUMENT, "INVALID_ARGUMENT"},
      {grpc::StatusCode::DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"},
      {grpc::StatusCode::NOT_FOUND, "NOT_FOUND"},
      {grpc::StatusCode::ALREADY_EXISTS, "ALREADY_EXISTS"},
      {grpc::StatusCode::PERMISSION_DENIED, "PERMISSION_DENIED"},
      {grpc::StatusCode::RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"},
      {grpc::StatusCode::FAILED_PRECONDITION, "FAILED_PRECONDITION"},
      {grpc::StatusCode::ABORTED, "ABORTED"},
      {grpc::StatusCode::OUT_OF_RANGE, "OUT_OF_RANGE"},
      {grpc::StatusCode::UNIMPLEMENTED, "UNIMPLEMENTED"},
      {grpc::StatusCode::INTERNAL, "INTERNAL"},
      {grpc::StatusCode::UNAVAILABLE, "UNAVAILABLE"},
      {grpc::StatusCode::DATA_LOSS, "DATA_LOSS"},
      {grpc::StatusCode::UNAUTHENTICATED, "UNAUTHENTICATED"},
  };
  for (const auto& [code, name] : names) EXPECT_EQ(GrpcCodeName(code), name);
}

}  // namespace
}  // namespace attnserve
