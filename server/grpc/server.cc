#include "server/grpc/server.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace attnserve {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, "=", path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const ServerOptions& o) {
  if (o.tls_cert.empty() && o.tls_key.empty()) {
    if (!o.tls_client_ca.empty()) {
      return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (o.tls_cert.empty() || o.tls_key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  auto cert = ReadFile(o.tls_cert, "--tls_cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadFile(o.tls_key, "--tls_key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!o.tls_client_ca.empty()) {
    auto ca = ReadFile(o.tls_client_ca, "--tls_client_ca");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

std::string HostOf(const std::string& address) {
  auto colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Start(const ServerOptions& options,
                                                              AttentionCore* core,
                                                              const TokenAuth* auth,
                                                              Metrics* metrics) {
  std::unique_ptr<AttnServer> s(new AttnServer());
  s->core_ = core;
  auto creds = Credentials(options);
  if (!creds.ok()) return creds.status();

  if (!options.metrics_listen.empty()) {
    try {
      s->exposer_ = std::make_unique<prometheus::Exposer>(options.metrics_listen);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("--metrics_listen=", options.metrics_listen, ": ", e.what()));
    }
    s->exposer_->RegisterCollectable(metrics->registry());
    auto ports = s->exposer_->GetListeningPorts();
    s->metrics_address_ = absl::StrCat(HostOf(options.metrics_listen), ":",
                                       ports.empty() ? 0 : ports[0]);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  s->service_ = std::make_unique<AttentionServiceImpl>(core, auth, metrics, options.access_log);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, *creds, &port);
  builder.RegisterService(s->service_.get());
  const int max_bytes = static_cast<int>(std::min<int64_t>(options.max_message_bytes, INT32_MAX));
  builder.SetMaxReceiveMessageSize(max_bytes);
  // Responses are checked against max_message_bytes; leave room for framing.
  builder.SetMaxSendMessageSize(static_cast<int>(
      std::min<int64_t>(options.max_message_bytes + (1 << 20), INT32_MAX)));
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("--listen=", options.listen, ": cannot bind"));
  }
  s->grpc_address_ = absl::StrCat(HostOf(options.listen), ":", port);
  grpc::HealthCheckServiceInterface* health = s->server_->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(kServiceName, true);
  return s;
}

AttnServer::~AttnServer() {
  if (server_) server_->Shutdown();
}

void AttnServer::SetNotServing() {
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus(false);
  health->SetServingStatus(kServiceName, false);
}

void AttnServer::Drain(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  SetNotServing();
  // While the listener stays open, new RPCs get UNAVAILABLE from the service
  // (a clear "go elsewhere") rather than the CANCELLED that a shut-down
  // server gives; accepted ones run to completion. The listener closes once
  // nothing accepted has been running for a short quiet period, so that a
  // client's follow-up call (e.g. FreePages after its Prefill) is refused
  // cleanly too.
  service_->StartDraining();
  constexpr int64_t kQuietNs = 200'000'000;
  while (absl::Now() < deadline &&
         (service_->accepted_inflight() > 0 ||
          absl::GetCurrentTimeNanos() - service_->last_accepted_finish_ns() < kQuietNs)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  server_->Shutdown(absl::ToChronoTime(deadline));
  core_->Shutdown();
}

void AttnServer::Wait() { server_->Wait(); }

}  // namespace attnserve
