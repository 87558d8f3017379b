// What Client::Connect checks before it connects, and what it says when the
// connection fails (client/connect_checks.h).
#include "client/connect_checks.h"

#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/flag_file.h"
#include "common/host_port.h"
#include "common/transport.h"

namespace attnserve {

absl::Status CheckClientOptions(const ClientOptions& o) {
  if (o.max_message_bytes < 1 || o.max_message_bytes > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes=", o.max_message_bytes,
                                                   " must be in [1, 2147483647]"));
  }
  if (!std::isfinite(o.timeout_s) || o.timeout_s < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_s=", o.timeout_s, " must be finite and >= 0 (0: no deadline)"));
  }
  if (!std::isfinite(o.connect_timeout_s) || o.connect_timeout_s <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("connect_timeout_s=", o.connect_timeout_s, " must be finite and > 0"));
  }
  if (o.target.empty()) {
    return absl::InvalidArgumentError("target is empty: the server's HOST:PORT (e.g. 127.0.0.1:50051)");
  }
  // HOST:PORT with a numeric port (not a gRPC URI such as unix:PATH): the
  // port is a TCP port.
  if (const std::optional<HostPort> hp = SplitHostPort(o.target);
      hp && o.target.find("://") == std::string::npos && !absl::StartsWith(o.target, "unix:") &&
      !absl::StartsWith(o.target, "unix-abstract:") && AllDigits(hp->port) && PortNumber(hp->port, 1) < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("target=", o.target, ": port ", hp->port, " out of range [1, 65535]"));
  }
  if (UsesTls(o)) {
    for (const auto& [name, value] : {std::pair{"tls_ca", &o.tls_ca}, std::pair{"tls_cert", &o.tls_cert},
                                      std::pair{"tls_key", &o.tls_key}}) {
      if (value->empty()) continue;
      if (auto read = ReadFlagFile(name, *value); !read.ok()) {
        return absl::InvalidArgumentError(read.status().message());
      }
    }
  }
  if (!o.tls_cert.empty() && o.tls_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tls_cert=", o.tls_cert, " needs tls_key (the certificate's key)"));
  }
  if (o.tls_cert.empty() && !o.tls_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("tls_key=", o.tls_key, " needs tls_cert (the key's certificate)"));
  }
  std::vector<std::string> arg_names;
  std::string arg_error;
  ParseTransportArgs(o.grpc_args, &arg_names, &arg_error);
  if (!arg_error.empty()) return absl::InvalidArgumentError(absl::StrCat("grpc_args: ", arg_error));
  return absl::OkStatus();
}

std::string ConnectCause(const grpc::Status& s, const ClientOptions& o) {
  if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return "";
  const std::string& m = s.error_message();
  const std::string ca = o.tls_ca.empty() ? "the system's root CAs" : "tls_ca=" + o.tls_ca;
  if (absl::StrContains(m, "DNS resolution failed") ||
      absl::StrContains(m, "Domain name not found")) {
    return absl::StrCat("cannot resolve the host of ", o.target, " (a typo?): ", m);
  }
  if (absl::StrContains(m, "Connection refused")) {
    return absl::StrCat("connection refused: nothing listens on ", o.target,
                        " (is attnserve running, and is this its --listen address?)");
  }
  if (absl::StrContains(m, "Failed parsing HTTP/2") || absl::StrContains(m, "http1") ||
      absl::StrContains(m, "HTTP/1")) {
    return absl::StrCat(o.target, " answers HTTP/1, not gRPC: is it attnserve's metrics port "
                        "(--metrics_listen) instead of its --listen address?");
  }
  if (absl::StrContains(m, "certificate verify failed") ||
      absl::StrContains(m, "CERTIFICATE_VERIFY_FAILED")) {
    return absl::StrCat("TLS: the certificate of ", o.target, " is not signed by ", ca,
                        " (or does not name the host): ", m);
  }
  if (absl::StrContains(m, "wrong version number") || absl::StrContains(m, "WRONG_VERSION_NUMBER")) {
    return absl::StrCat("TLS: ", o.target, " does not speak TLS (a server without --tls_cert): "
                        "connect without tls, tls_ca or tls_cert");
  }
  // A server that wants client certificates (--tls_client_ca) closes the
  // connection once the handshake has shown the client's.
  const std::string mtls =
      o.tls_cert.empty()
          ? "a server with --tls_client_ca wants a client certificate (tls_cert, tls_key)"
          : absl::StrCat("a server with --tls_client_ca refuses a client certificate its CA did "
                         "not sign (tls_cert=", o.tls_cert, ")");
  if (absl::StrContains(m, "andshake failed")) {
    return absl::StrCat("TLS handshake with ", o.target, " failed (", mtls, "?): ", m);
  }
  if (absl::StrContains(m, "Socket closed") || absl::StrContains(m, "Connection reset")) {
    if (!o.tls) {
      return absl::StrCat(o.target, " closed the connection before answering: if it is a TLS "
                          "server (--tls_cert), connect with tls (and tls_ca)");
    }
    return absl::StrCat(o.target, " closed the connection after the TLS handshake: ", mtls);
  }
  return "";
}

}  // namespace attnserve
