#include "client/cli_flags.h"

#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "grpc/support/log.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "server address");
ABSL_FLAG(std::string, token, "", "bearer token (also $ATTNSERVE_TOKEN)");
ABSL_FLAG(bool, tls, false, "use TLS");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA of the server certificate");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate (mTLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM client key (mTLS)");
ABSL_FLAG(double, timeout_s, 60, "per-call deadline in seconds");
ABSL_FLAG(double, connect_timeout_s, 10,
          "seconds to wait for the server at connect; a named cause (connection refused, a host "
          "that does not resolve, a TLS mismatch, an HTTP/1 port) fails at once");
ABSL_FLAG(bool, transport_tuning, true,
          "gRPC HTTP/2 and TCP settings for large tensors (docs/transport.md); false: gRPC's "
          "defaults");
ABSL_FLAG(std::string, grpc_args, "", "extra gRPC channel arguments NAME=INT,... (experiments)");
ABSL_FLAG(bool, busy_poll, false,
          "poll for tensor-carrying responses instead of sleeping (lower latency, one busy core "
          "per waiting call)");

namespace attnserve {
namespace {

// gRPC's own log lines (a failed TLS handshake, a refused connection, each
// time it retries) go nowhere: the programs print the call's status, which
// names the cause. GRPC_VERBOSITY set in the environment brings them back.
void DropGrpcLog(gpr_log_func_args*) {}

}  // namespace

void HideGrpcLogs() {
  if (std::getenv("GRPC_VERBOSITY") == nullptr) gpr_set_log_function(DropGrpcLog);
}

ClientOptions ClientOptionsFromFlags() {
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.token = absl::GetFlag(FLAGS_token);
  if (options.token.empty() && std::getenv("ATTNSERVE_TOKEN") != nullptr) {
    options.token = std::getenv("ATTNSERVE_TOKEN");
  }
  options.tls = absl::GetFlag(FLAGS_tls);
  options.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.timeout_s = absl::GetFlag(FLAGS_timeout_s);
  options.connect_timeout_s = absl::GetFlag(FLAGS_connect_timeout_s);
  options.transport_tuning = absl::GetFlag(FLAGS_transport_tuning);
  options.grpc_args = absl::GetFlag(FLAGS_grpc_args);
  options.busy_poll = absl::GetFlag(FLAGS_busy_poll);
  return options;
}

absl::Status CheckAttentionFlags();  // variant_flags.cc

absl::Status CheckClientFlags() {
  if (absl::Status s = CheckClientOptions(ClientOptionsFromFlags()); !s.ok()) {
    // Named as the flags they came from.
    return absl::InvalidArgumentError(absl::StrCat("--", s.message()));
  }
  return CheckAttentionFlags();
}

}  // namespace attnserve
