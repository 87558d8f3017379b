// RegionSocket: the edge through which a client on the server's host hands
// the server the memory of a system region (docs/transport.md,
// "Shared-memory regions"; the bytes are common/region_socket.h). A Unix
// SOCK_SEQPACKET socket: each connection gets a hello, then sends one
// deposit (a claim token and a memfd by SCM_RIGHTS), which becomes a
// RegionDeposit for the core (AttentionCore::DepositRegion); the core's
// answer goes back as the reply. It converts, and decides nothing about
// regions: the core checks the memfd, holds it and bounds what it holds.
//
// Nothing here is authenticated (any local process that can reach the
// socket may connect), so everything it holds is bounded: one thread polls
// the listener and the connections that have not deposited yet, at most
// max_connections of them (the next one is answered RESOURCE_EXHAUSTED and
// closed), each closed when it has sent nothing within connection_timeout.
// A connection whose deposit the core took is the deposit's holder and
// leaves this loop. Once a second the thread has the core close deposits
// that expired or whose connection closed.
//
//   RegionSocketOptions o;
//   o.name = DefaultRegionSocket(port);   // "@attnserve-PORT"
//   o.incarnation = core->incarnation();
//   auto socket = RegionSocket::Start(o, core);   // fails if the name is taken
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"
#include "server/core/attention_core.h"

namespace attnserve {

struct RegionSocketOptions {
  std::string name;              // "@NAME" (abstract namespace) or a path
  uint64_t incarnation = 0;      // sent in the hello
  int32_t max_connections = 64;  // connections not yet deposited, at once
  absl::Duration connection_timeout = absl::Seconds(10);
};

class RegionSocket {
 public:
  // Binds `options.name` and starts the thread. A path that holds a socket
  // nobody listens on any more (a server that was killed) is replaced; a
  // name in use, a path that is not a socket, or a name that does not fit a
  // Unix socket address is an error naming --region_socket.
  static absl::StatusOr<std::unique_ptr<RegionSocket>> Start(const RegionSocketOptions& options,
                                                             AttentionCore* core);
  // Stops the thread, closes the connections not yet deposited and the
  // listener, and removes the path it bound.
  ~RegionSocket();
  RegionSocket(const RegionSocket&) = delete;
  RegionSocket& operator=(const RegionSocket&) = delete;

  const std::string& name() const { return options_.name; }

 private:
  RegionSocket(RegionSocketOptions options, AttentionCore* core)
      : options_(std::move(options)), core_(core) {}
  void Run();

  const RegionSocketOptions options_;
  AttentionCore* const core_;
  UniqueFd listener_;
  UniqueFd wake_;  // eventfd: the destructor's stop
  bool bound_path_ = false;
  std::thread thread_;
};

}  // namespace attnserve
