#include "client/cli_flags.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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

ABSL_FLAG(int32_t, window_left, -1,
          "prefill: sliding window, a row at position p sees keys p - window_left .. p; -1: none");
ABSL_FLAG(float, soft_cap, 0, "prefill: logit soft-cap c, logits become c * tanh(x / c); 0: none");
ABSL_FLAG(std::string, sinks, "",
          "prefill: attention sinks, one logit per query head: 'random', one number for every "
          "head, or num_qo_heads comma-separated numbers; empty: none");

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

}  // namespace attnserve

namespace attnserve {

absl::StatusOr<AttentionOptions> AttentionOptionsFromFlags(int32_t num_qo_heads,
                                                           std::mt19937_64& gen) {
  AttentionOptions o;
  if (const int32_t w = absl::GetFlag(FLAGS_window_left); w != -1) o.window_left = w;
  if (const float c = absl::GetFlag(FLAGS_soft_cap); c != 0.f) o.logits_soft_cap = c;
  const std::string sinks = absl::GetFlag(FLAGS_sinks);
  if (sinks.empty()) return o;
  if (sinks == "random") {
    std::normal_distribution<float> dist(0.f, 1.f);
    for (int32_t h = 0; h < num_qo_heads; ++h) o.sinks.push_back(dist(gen));
    return o;
  }
  for (absl::string_view part : absl::StrSplit(sinks, ',')) {
    float x = 0;
    if (!absl::SimpleAtof(part, &x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sinks=", sinks, ": '", part, "' is not a number"));
    }
    o.sinks.push_back(x);
  }
  if (o.sinks.size() == 1) o.sinks.assign(num_qo_heads, o.sinks[0]);
  return o;
}

}  // namespace attnserve
