// Connection flags shared by the command-line clients (attnctl, attnbench):
// --target, --token (or $ATTNSERVE_TOKEN), --tls, --tls_ca, --tls_cert,
// --tls_key, --timeout_s, --connect_timeout_s.
#pragma once

#include "client/client.h"

namespace attnserve {

// ClientOptions from the connection flags, read after ParseCommandLine.
ClientOptions ClientOptionsFromFlags();

// Keeps gRPC's own log lines off stderr (unless GRPC_VERBOSITY is set): the
// programs print each failed call's status instead. Call once at start.
void HideGrpcLogs();

}  // namespace attnserve
