// SharedMemory: memory this process shares with a server on the same host
// as a system region (docs/transport.md, "Shared-memory regions"): a memfd,
// sized once and sealed so that it can never shrink or grow, mapped
// read-write here.
//
//   auto shm = attnserve::SharedMemory::Create("my_client_q", 1 << 20);
//   client->RegisterSystemRegion("q", **shm, 0, (*shm)->size());
//   std::memcpy((*shm)->data(), q.data(), q_bytes);   // then name {"q", 0, q_bytes}
//
// The memory has no name in /dev/shm: only a process that holds its file
// descriptor can map it, which is how the server knows the region is the
// caller's to register. Registering sends the descriptor over the server's
// region socket (DepositRegionFd) and names it by a random claim token in
// RegisterRegion. The mapping here goes when the SharedMemory is destroyed;
// a server that mapped it keeps its own mapping (and so the memory) until
// the region is unregistered or reclaimed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/unique_fd.h"

namespace attnserve {

class SharedMemory {
 public:
  // A memfd named `name` (shown by ListRegions as the region's key and in
  // /proc; need not be unique) of `bytes` zeroed bytes, sealed with
  // F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, and mapped read-write.
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(const std::string& name,
                                                              int64_t bytes);
  ~SharedMemory();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  const std::string& name() const { return name_; }
  int fd() const { return fd_.get(); }
  char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  SharedMemory() = default;
  std::string name_;
  UniqueFd fd_;
  char* data_ = nullptr;
  int64_t size_ = 0;
};

// What a deposit leaves the client: the token RegisterRegion names
// (system.claim_token), and the connection that holds the region: keep it
// open while the region is in use (the server reclaims an idle region whose
// holder closed).
struct RegionClaim {
  std::string claim_token;
  UniqueFd holder;
};

// Sends memfd `fd` (sealed with at least F_SEAL_SHRINK) to the server's
// region socket `socket` (ServerInfo.region_socket) under a fresh random
// claim token (common/region_socket.h has the protocol). When
// `expected_incarnation` is non-zero the server's hello must carry it
// (FAILED_PRECONDITION otherwise: the server restarted, or another process
// holds the socket), so that the descriptor goes to the server the caller
// talks to. The server's refusal comes back with its code and message;
// UNAVAILABLE when the socket cannot be reached; DEADLINE_EXCEEDED past
// `timeout_s`.
absl::StatusOr<RegionClaim> DepositRegionFd(const std::string& socket, int fd,
                                            uint64_t expected_incarnation,
                                            double timeout_s = 10);

}  // namespace attnserve
