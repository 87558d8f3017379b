// AttnServer: builds and runs the gRPC server (AttentionService, standard
// health checks, reflection) and the Prometheus endpoint.
//
// Both ports are exclusive: gRPC's SO_REUSEPORT is turned off, so a second
// server on a port the first holds fails to start with a clear error instead
// of sharing its clients (and their KV state) with the first.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/core/attention_core.h"
#include "server/grpc/attention_service.h"
#include "server/grpc/auth.h"
#include "server/grpc/health_service.h"
#include "server/metrics.h"

namespace attnserve {

struct ServerOptions {
  std::string listen = "127.0.0.1:50051";
  std::string metrics_listen = "127.0.0.1:9464";  // empty: no metrics endpoint
  std::string tls_cert;       // PEM; with tls_key turns on TLS
  std::string tls_key;
  std::string tls_client_ca;  // PEM; also require client certificates (mTLS)
  int64_t max_message_bytes = 512ll << 20;
  bool access_log = false;    // one log line per RPC
  bool reflection = true;     // serve gRPC server reflection (it needs no token)
  // gRPC's HTTP/2 and TCP arguments for large messages (common/transport.h);
  // false: gRPC's defaults. grpc_args: "name=int,..." applied after them.
  bool transport_tuning = true;
  std::string grpc_args;
  // Request channels: microseconds each channel's poller spins after the
  // last request before it sleeps (--channel_spin_us).
  int64_t channel_spin_us = 200;
  // The region socket (server/region_socket/), served when the core has
  // regions on: "@NAME", a path, or empty for DefaultRegionSocket(the bound
  // gRPC port).
  std::string region_socket;
  // What one connection, and a sender, may hold (docs/security.md, "What
  // hostile input costs"): gRPC's own limits, as channel arguments.
  struct Limits {
    int max_streams_per_connection = 256;                  // --max_streams_per_connection
    absl::Duration connection_idle = absl::Minutes(5);     // --connection_idle_timeout_s
    absl::Duration keepalive = absl::Seconds(60);          // --keepalive_s
    absl::Duration keepalive_timeout = absl::Seconds(20);
    absl::Duration handshake_timeout = absl::Seconds(10);  // --handshake_timeout_s
    absl::Duration request_read_timeout = absl::Seconds(60);  // --request_read_timeout_s
  } limits;
};

class MetricsEndpoint;
class RegionSocket;

class AttnServer {
 public:
  static absl::StatusOr<std::unique_ptr<AttnServer>> Start(const ServerOptions& options,
                                                           AttentionCore* core,
                                                           const TokenAuth* auth,
                                                           Metrics* metrics);
  ~AttnServer();

  // Address actually bound (port 0 resolved).
  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  // The region socket's name ("" when regions are off).
  const std::string& region_socket() const { return region_socket_name_; }

  // Graceful drain: health NOT_SERVING, new RPCs UNAVAILABLE, accepted RPCs
  // run to completion for up to `timeout`; RPCs still running then are
  // answered UNAVAILABLE and abandoned. The listener then closes and, when
  // nothing was abandoned, the core is shut down. Returns the RPCs
  // abandoned: when non-zero the backend may still be running a batch, and
  // the process should exit without waiting for it.
  int Drain(absl::Duration timeout);
  // Health NOT_SERVING (e.g. after a backend fault); the server keeps
  // answering so that operators can read its state.
  void SetNotServing();
  void Wait();

 private:
  AttnServer();

  AttentionCore* core_ = nullptr;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<HealthService> health_;  // outlives server_
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  std::unique_ptr<RegionSocket> region_socket_;
  std::string grpc_address_;
  std::string metrics_address_;
  std::string region_socket_name_;
};

}  // namespace attnserve
