// What Client::Connect checks before it connects, and what it says when the
// connection fails: the options (CheckClientOptions, declared in
// client/client.h) and the cause of a failed connection in terms of them.
#pragma once

#include <string>

#include "client/client.h"
#include "grpcpp/support/status.h"

namespace attnserve {

// The cause of a failed connection that gRPC's status names, said in terms
// of attnserve's options; empty when the status names none a client can act
// on (then the address may still become ready).
std::string ConnectCause(const grpc::Status& s, const ClientOptions& o);

}  // namespace attnserve
