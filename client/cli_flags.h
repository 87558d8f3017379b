// Connection flags shared by the command-line clients (attnctl, attnbench):
// --target, --token (or $ATTNSERVE_TOKEN), --tls, --tls_ca, --tls_cert,
// --tls_key, --timeout_s.
#pragma once

#include "client/client.h"

namespace attnserve {

// ClientOptions from the connection flags, read after ParseCommandLine.
ClientOptions ClientOptionsFromFlags();

}  // namespace attnserve
