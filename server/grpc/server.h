// AttnServer: builds and runs the gRPC server (AttentionService, standard
// health checks, reflection) and the Prometheus exposer.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "prometheus/exposer.h"
#include "server/core/attention_core.h"
#include "server/grpc/attention_service.h"
#include "server/grpc/auth.h"
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
};

inline constexpr char kServiceName[] = "attnserve.v1.AttentionService";

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

  // Graceful drain: health NOT_SERVING, new RPCs UNAVAILABLE, in-flight RPCs
  // finish (cancelled after `timeout`), then the core's queue is drained.
  void Drain(absl::Duration timeout);
  // Health NOT_SERVING (e.g. after a backend fault); the server keeps
  // answering so that operators can read its state.
  void SetNotServing();
  void Wait();

 private:
  AttnServer() = default;

  AttentionCore* core_ = nullptr;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string grpc_address_;
  std::string metrics_address_;
};

}  // namespace attnserve
