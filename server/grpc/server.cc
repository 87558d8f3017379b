#include "server/grpc/server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "CivetServer.h"
#include "common/flag_file.h"
#include "common/region_socket.h"
#include "openssl/err.h"
#include "openssl/pem.h"
#include "openssl/x509.h"
#include "common/transport.h"
#include "prometheus/text_serializer.h"
#include "server/core/status_macros.h"
#include "server/region_socket/region_socket.h"
#include "server/process_metrics.h"

namespace attnserve {
namespace {

// OpenSSL's objects, freed with their own functions.
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Bio = std::unique_ptr<BIO, BioFree>;

Bio MemBio(const std::string& pem) { return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()))); }

// The first certificate of a PEM file, or null.
std::unique_ptr<X509, X509Free> FirstCert(const std::string& pem) {
  Bio bio = MemBio(pem);
  return std::unique_ptr<X509, X509Free>(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
}

// Never asks for a passphrase (OpenSSL's default callback reads the
// terminal): an encrypted key does not load.
int NoPassphrase(char*, int, int, void*) { return 0; }

// The TLS files as gRPC would use them, checked before the server starts:
// gRPC only fails to listen, which the operator would read as a port
// problem. A certificate that parses, an unencrypted private key that
// matches it, and client CAs that parse; INVALID_ARGUMENT naming the flag.
absl::Status CheckTlsFiles(const ServerOptions& o, const std::string& cert_pem, const std::string& key_pem,
                           const std::string* ca_pem) {
  auto cert = FirstCert(cert_pem);
  absl::Status status;
  if (cert == nullptr) {
    status = absl::InvalidArgumentError(
        absl::StrCat("--tls_cert=", o.tls_cert, ": holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
  } else {
    Bio bio = MemBio(key_pem);
    std::unique_ptr<EVP_PKEY, PkeyFree> key(
        bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr) : nullptr);
    if (key == nullptr) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "--tls_key=", o.tls_key, ": holds no unencrypted PEM private key (-----BEGIN PRIVATE KEY-----)"));
    } else if (X509_check_private_key(cert.get(), key.get()) != 1) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "--tls_key=", o.tls_key, ": is not the private key of the certificate in --tls_cert=", o.tls_cert));
    } else if (ca_pem != nullptr && FirstCert(*ca_pem) == nullptr) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "--tls_client_ca=", o.tls_client_ca, ": holds no PEM certificate (-----BEGIN CERTIFICATE-----)"));
    }
  }
  ERR_clear_error();  // gRPC reads OpenSSL's error queue for its own calls
  return status;
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
  auto cert = ReadFlagFile("--tls_cert", o.tls_cert);
  if (!cert.ok()) return cert.status();
  auto key = ReadFlagFile("--tls_key", o.tls_key);
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  absl::StatusOr<std::string> ca;
  if (!o.tls_client_ca.empty()) {
    ca = ReadFlagFile("--tls_client_ca", o.tls_client_ca);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  ATTN_RETURN_IF_ERROR(CheckTlsFiles(o, *cert, *key, o.tls_client_ca.empty() ? nullptr : &*ca));
  return grpc::SslServerCredentials(ssl);
}

std::string HostOf(const std::string& address) {
  auto colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

// Fails with a clear message when something already listens on `address`
// (host:port; port 0 always passes). gRPC and civetweb only say that they
// could not start.
absl::Status CheckPortFree(const std::string& address, absl::string_view flag) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return absl::OkStatus();  // left to the server to reject
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (port == "0") return absl::OkStatus();
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0) {
    return absl::OkStatus();  // left to the server to reject
  }
  absl::Status status;
  for (addrinfo* a = found; a != nullptr && status.ok(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // TIME_WAIT is no clash
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE) {
      status = absl::AlreadyExistsError(absl::StrCat(
          flag, "=", address, ": the address is already in use (another attnserve, or another "
          "program, listens there); stop it or choose another port"));
    }
    close(fd);
  }
  freeaddrinfo(found);
  return status;
}

// Takes gRPC's reflection plugin out of a server: linking the reflection
// library registers it for every server, and reflection answers without a
// token.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
                                    return p->name() == "proto_server_reflection";
                                  }),
                   plugins->end());
  }
};

}  // namespace

// Serves the registry in the Prometheus text format at /metrics.
class MetricsEndpoint final : public CivetHandler {
 public:
  // before_collect runs at each scrape, before the registry is read (gauges
  // sampled then).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& listen, std::shared_ptr<prometheus::Registry> registry,
      std::function<void()> before_collect) {
    ATTN_RETURN_IF_ERROR(CheckPortFree(listen, "--metrics_listen"));
    std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint(std::move(registry)));
    e->before_collect_ = std::move(before_collect);
    try {
      // A connection that sends no request holds a thread for at most
      // request_timeout_ms (civetweb's default, 30 s, let two idle
      // connections stall every scrape past Prometheus's 10 s timeout).
      e->server_ = std::make_unique<CivetServer>(std::vector<std::string>{
          "listening_ports", listen, "num_threads", "4", "request_timeout_ms", "2000"});
    } catch (const std::exception& ex) {
      return absl::UnavailableError(
          absl::StrCat("--metrics_listen=", listen, ": cannot serve metrics there: ", ex.what()));
    }
    e->server_->addHandler("/metrics", e.get());
    const std::vector<int> ports = e->server_->getListeningPorts();
    e->port_ = ports.empty() ? 0 : ports[0];
    return e;
  }

  ~MetricsEndpoint() override {
    if (server_) server_->removeHandler("/metrics");
  }

  int port() const { return port_; }

  bool handleGet(CivetServer*, mg_connection* conn) override {
    const std::string body = Body();
    WriteHeaders(conn, body.size());
    mg_write(conn, body.data(), body.size());
    return true;
  }

  // What GET answers, without the body (load balancers and probes ask so).
  bool handleHead(CivetServer*, mg_connection* conn) override {
    WriteHeaders(conn, Body().size());
    return true;
  }

 private:
  // The registry's families and the process's own (server/process_metrics.h).
  std::string Body() const {
    if (before_collect_) before_collect_();
    std::vector<prometheus::MetricFamily> families = registry_->Collect();
    AppendProcessMetrics(&families);
    return prometheus::TextSerializer().Serialize(families);
  }

  static void WriteHeaders(mg_connection* conn, size_t content_length) {
    mg_printf(conn,
              "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
              "Content-Length: %zu\r\nConnection: close\r\n\r\n",
              content_length);
  }

  explicit MetricsEndpoint(std::shared_ptr<prometheus::Registry> registry)
      : registry_(std::move(registry)) {}

  std::shared_ptr<prometheus::Registry> registry_;
  std::function<void()> before_collect_;
  std::unique_ptr<CivetServer> server_;
  int port_ = 0;
};

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Start(const ServerOptions& options,
                                                              AttentionCore* core,
                                                              const TokenAuth* auth,
                                                              Metrics* metrics) {
  std::unique_ptr<AttnServer> s(new AttnServer());
  s->core_ = core;
  auto creds = Credentials(options);
  if (!creds.ok()) return creds.status();

  ATTN_RETURN_IF_ERROR(CheckPortFree(options.listen, "--listen"));
  if (!options.metrics_listen.empty()) {
    auto endpoint = MetricsEndpoint::Start(options.metrics_listen, metrics->registry(),
                                           [core] { core->SampleGauges(); });
    if (!endpoint.ok()) return endpoint.status();
    s->metrics_endpoint_ = *std::move(endpoint);
    s->metrics_address_ =
        absl::StrCat(HostOf(options.metrics_listen), ":", s->metrics_endpoint_->port());
  }

  // Health is ours, not gRPC's default service: its requests are bounded
  // (server/grpc/health_service.h).
  grpc::EnableDefaultHealthCheckService(false);
  s->health_ = std::make_unique<HealthService>(options.limits.request_read_timeout);
  if (options.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  ServiceOptions service_options;
  service_options.access_log = options.access_log;
  service_options.read_timeout = options.limits.request_read_timeout;
  service_options.channels.spin_us = options.channel_spin_us;
  s->service_ = std::make_unique<AttentionServiceImpl>(core, auth, metrics, service_options);
  grpc::ServerBuilder builder;
  // One server per port: with SO_REUSEPORT a second server on the same port
  // would start and take half of the first one's connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // What a connection may hold: gRPC's own bounds. Streams at once; a
  // connection with no call for connection_idle is closed (clients reconnect
  // on their next call); the server pings a connection idle for keepalive
  // and closes it when the ping goes unanswered (a peer that vanished); a
  // connection must finish its TLS and HTTP/2 handshake within
  // handshake_timeout.
  const ServerOptions::Limits& limits = options.limits;
  auto ms = [](absl::Duration d) {
    return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d), INT32_MAX));
  };
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, limits.max_streams_per_connection);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, ms(limits.connection_idle));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ms(limits.keepalive));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(limits.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, ms(limits.handshake_timeout));
  // Clients may ping as often as every 10 s (the clients' own keepalive).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  for (const TransportArg& arg : TransportArgs(options.transport_tuning)) {
    builder.AddChannelArgument(arg.name, arg.value);
  }
  std::vector<std::string> arg_names;
  std::string arg_error;
  for (const TransportArg& arg : ParseTransportArgs(options.grpc_args, &arg_names, &arg_error)) {
    builder.AddChannelArgument(arg.name, arg.value);
  }
  if (!arg_error.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--grpc_args: ", arg_error));
  }
  if (!options.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  int port = 0;
  builder.AddListeningPort(options.listen, *creds, &port);
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->health_.get());
  // gRPC checks a message's size only once the whole message has arrived,
  // as the service does: the service's check names --max_message_bytes
  // (gRPC's would not), so gRPC's own limit is its largest.
  builder.SetMaxReceiveMessageSize(INT32_MAX);
  // Responses are checked against max_message_bytes; leave room for framing.
  builder.SetMaxSendMessageSize(static_cast<int>(
      std::min<int64_t>(options.max_message_bytes + (1 << 20), INT32_MAX)));
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "--listen=", options.listen, ": cannot listen there (address in use, not local, or "
        "malformed)"));
  }
  s->grpc_address_ = absl::StrCat(HostOf(options.listen), ":", port);
  if (core->regions_enabled()) {
    RegionSocketOptions region_options;
    region_options.name =
        options.region_socket.empty() ? DefaultRegionSocket(port) : options.region_socket;
    region_options.incarnation = core->incarnation();
    auto region_socket = RegionSocket::Start(region_options, core);
    if (!region_socket.ok()) return region_socket.status();
    s->region_socket_ = *std::move(region_socket);
    s->region_socket_name_ = region_options.name;
    s->service_->SetRegionSocket(region_options.name);
  }
  return s;
}

AttnServer::~AttnServer() {
  region_socket_.reset();
  if (health_) health_->Shutdown();
  if (server_) server_->Shutdown();
}

AttnServer::AttnServer() = default;

void AttnServer::SetNotServing() { health_->SetServing(false); }

int AttnServer::Drain(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  SetNotServing();
  // While the listener stays open, new RPCs get UNAVAILABLE from the service
  // (a clear "go elsewhere") rather than the CANCELLED that a shut-down
  // server gives; accepted ones run to completion. The listener closes once
  // nothing accepted has been running for a short quiet period, so that a
  // client's follow-up call (e.g. FreePages after its Prefill) is refused
  // cleanly too.
  service_->StartDraining();
  region_socket_.reset();  // no more deposits: RegisterRegion is refused now
  constexpr int64_t kQuietNs = 200'000'000;
  while (absl::Now() < deadline &&
         (service_->accepted_inflight() > 0 ||
          absl::GetCurrentTimeNanos() - service_->last_accepted_finish_ns() < kQuietNs)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  // What still runs at the deadline is answered now and abandoned.
  const int abandoned = service_->AbandonInflight(absl::UnavailableError(absl::StrCat(
      "server shut down before the request finished (drain timeout ",
      absl::FormatDuration(timeout), ")")));
  // Every RPC is finished: this only closes the listener and the connections
  // (an idle client's connection included) and waits for the last responses
  // to leave.
  health_->Shutdown();  // health Watch streams end
  server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Milliseconds(200)));
  if (abandoned == 0) core_->Shutdown();  // nothing queued or running: returns at once
  return abandoned;
}

void AttnServer::Wait() { server_->Wait(); }

}  // namespace attnserve
