// The region socket (docs/transport.md, "Shared-memory regions"): the Unix
// socket through which a client on the server's host hands the server the
// memory of a system region, a sealed memfd, before RegisterRegion names
// it. Shared by the server's listener (server/region_socket/) and the C++
// client (client/shared_memory.h); the Python client speaks the same bytes
// (attnserve/regions.py).
//
// One connection per region, SOCK_SEQPACKET (each message arrives whole):
//
//   server -> client  RegionSocketHello     16 bytes, on accept
//   client -> server  RegionDepositMessage  24 bytes, with exactly one file
//                                           descriptor (SCM_RIGHTS): the memfd
//   server -> client  reply                 int32 code (0: deposited, else a
//                                           gRPC status code), then the
//                                           message (UTF-8, at most
//                                           kRegionReplyMaxMessage bytes)
//
// All integers little-endian. After an OK reply the connection is the
// region's holder: the client keeps it open while it uses the region, and
// the server, which reads nothing more from it, drops an idle region whose
// holder closed (the client exited, or let go of it) at the tenant's next
// RegisterRegion or ListRegions. After an error reply the server closes it.
//
// The deposit is claimed by RegisterRegion{system{claim_token, offset,
// byte_size}} over gRPC, which authenticates the caller: the region is that
// tenant's. The token is 16 random bytes that only the client and the
// server see.
#pragma once

#include <stddef.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace attnserve {

inline constexpr uint32_t kRegionSocketMagic = 0x47455241;  // "AREG"
inline constexpr uint32_t kRegionSocketVersion = 1;
inline constexpr size_t kClaimTokenBytes = 16;
inline constexpr size_t kRegionReplyMaxMessage = 1024;

struct RegionSocketHello {
  uint32_t magic = kRegionSocketMagic;
  uint32_t version = kRegionSocketVersion;
  uint64_t incarnation = 0;  // the server's (ServerInfo.incarnation)
};
static_assert(sizeof(RegionSocketHello) == 16);

struct RegionDepositMessage {
  uint32_t magic = kRegionSocketMagic;
  uint32_t version = kRegionSocketVersion;
  char claim_token[kClaimTokenBytes] = {};
};
static_assert(sizeof(RegionDepositMessage) == 24);

// The default name of a server's region socket: "@attnserve-PORT", PORT
// its gRPC port, in the abstract namespace (no file; gone with the server).
inline std::string DefaultRegionSocket(int port) {
  return "@attnserve-" + std::to_string(port);
}

// The address of region socket `name`: "@NAME" is NAME in Linux's abstract
// namespace, anything else a filesystem path. False when it does not fit a
// sockaddr_un (or is empty).
inline bool RegionSocketAddress(const std::string& name, sockaddr_un* addr, socklen_t* len) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  if (name.size() < 2 && (name.empty() || name[0] == '@')) return false;
  if (name[0] == '@') {
    // sun_path[0] stays 0; the name follows, not terminated.
    if (name.size() > sizeof(addr->sun_path)) return false;
    std::memcpy(addr->sun_path + 1, name.data() + 1, name.size() - 1);
    *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
    return true;
  }
  if (name.size() >= sizeof(addr->sun_path) || name.find('\0') != std::string::npos) return false;
  std::memcpy(addr->sun_path, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() + 1);
  return true;
}

}  // namespace attnserve
