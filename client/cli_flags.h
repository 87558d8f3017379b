// Flags shared by the command-line clients (attnctl, attnbench): the
// connection's (client/cli_flags.cc: --target, --token (or
// $ATTNSERVE_TOKEN), --tls, --tls_ca, --tls_cert, --tls_key, --timeout_s,
// --connect_timeout_s, --transport_tuning, --grpc_args, --busy_poll) and the
// attention options of their Prefills (client/variant_flags.cc:
// --window_left, --soft_cap, --sinks; docs/design.md, "Variants").
#pragma once

#include <cstdint>
#include <random>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace attnserve {

// ClientOptions from the connection flags, read after ParseCommandLine.
ClientOptions ClientOptionsFromFlags();

// AttentionOptions from --window_left (-1: none), --soft_cap (0: none) and
// --sinks ("": none; "random": one N(0, 1) logit per query head drawn from
// gen; one number: that logit for every head; else num_qo_heads
// comma-separated numbers, "-inf" allowed). INVALID_ARGUMENT naming --sinks
// when it does not parse.
absl::StatusOr<AttentionOptions> AttentionOptionsFromFlags(int32_t num_qo_heads,
                                                           std::mt19937_64& gen);

// The flag errors a command-line tool reports before it connects (and exits
// 2 for): the connection flags Client::Connect would refuse
// (CheckClientOptions) and a --sinks that does not parse.
absl::Status CheckClientFlags();

// Keeps gRPC's own log lines off stderr (unless GRPC_VERBOSITY is set): the
// programs print each failed call's status instead. Call once at start.
void HideGrpcLogs();

}  // namespace attnserve
