// The server's flags, read once and checked into the options structs of the
// layers below (docs/operations.md, "Flags"). A flag error is the only
// thing this reads: the backend, the token file and the listeners are
// main.cc's to start.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/backend/factory.h"
#include "server/core/attention_core.h"
#include "server/grpc/server.h"

namespace attnserve {

// Where the flags are defined, for --help (common/usage.h).
inline constexpr char kServerFlagsSource[] = "server/flags.cc";

struct StartOptions {
  std::string log_level;           // trace, debug, info, warn or error
  bool retain_freed_memory = true;
  KvGeometry geometry;             // also backend.geometry
  CoreOptions core;
  BackendOptions backend;
  std::string prefill_kernel;      // --prefill_kernel as given (main's messages)
  std::string auth_tokens_file;
  ServerOptions server;            // but reflection, which needs the token file
  std::string reflection;          // auto, on or off
  absl::Duration drain_timeout;
};

// Every flag read and checked, in the order the options are listed above:
// INVALID_ARGUMENT with the message the server prints before it exits 2
// (the flag, its value and the bound) for the first flag at fault.
absl::StatusOr<StartOptions> StartOptionsFromFlags();

}  // namespace attnserve
