#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/region_socket.h"

namespace attnserve {
namespace {

absl::Status SocketError(const std::string& socket, absl::string_view what, int err) {
  const std::string text = absl::StrCat("region socket ", socket, ": ", what, ": ",
                                        std::strerror(err));
  if (err == EAGAIN || err == EWOULDBLOCK) {
    return absl::DeadlineExceededError(absl::StrCat(text, " (no answer in time)"));
  }
  return absl::UnavailableError(text);
}

// A reply's status: its code and message, as the server sent them.
absl::Status ReplyStatus(const std::string& socket, const char* bytes, size_t n) {
  int32_t code = 0;
  std::memcpy(&code, bytes, sizeof(code));
  if (code == 0) return absl::OkStatus();
  const auto status_code =
      code > 0 && code <= 16 ? static_cast<absl::StatusCode>(code) : absl::StatusCode::kUnknown;
  return absl::Status(status_code,
                      absl::StrCat("region socket ", socket, ": ",
                                   absl::string_view(bytes + sizeof(code), n - sizeof(code))));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(const std::string& name,
                                                                   int64_t bytes) {
  if (bytes < 1) return absl::InvalidArgumentError(absl::StrCat("bytes=", bytes, " must be >= 1"));
  UniqueFd fd(memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) {
    return absl::UnavailableError(
        absl::StrCat("memfd_create '", name, "': ", std::strerror(errno)));
  }
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ftruncate memfd '", name, "' to ", bytes, ": ", std::strerror(errno)));
  }
  // Never shrinks (what the server requires: memory cut under its mapping
  // would fault there), never grows, and the seals are final.
  if (fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::InternalError(
        absl::StrCat("sealing memfd '", name, "': ", std::strerror(errno)));
  }
  void* data =
      mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (data == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap memfd '", name, "': ", std::strerror(errno)));
  }
  std::unique_ptr<SharedMemory> shm(new SharedMemory());
  shm->name_ = name;
  shm->fd_ = std::move(fd);
  shm->data_ = static_cast<char*>(data);
  shm->size_ = bytes;
  return shm;
}

SharedMemory::~SharedMemory() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_));
}

absl::StatusOr<RegionClaim> DepositRegionFd(const std::string& socket, int fd,
                                            uint64_t expected_incarnation, double timeout_s) {
  sockaddr_un addr{};
  socklen_t len = 0;
  if (!RegionSocketAddress(socket, &addr, &len)) {
    return absl::InvalidArgumentError(
        absl::StrCat("region socket '", socket, "' is not a Unix socket name"));
  }
  RegionClaim claim;
  claim.claim_token.resize(kClaimTokenBytes);
  if (getrandom(claim.claim_token.data(), kClaimTokenBytes, 0) !=
      static_cast<ssize_t>(kClaimTokenBytes)) {
    return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
  }
  UniqueFd conn(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!conn.valid()) return SocketError(socket, "socket", errno);
  // (The socket's own timeouts: a non-finite or huge one capped at a day.)
  const double seconds = timeout_s > 0 ? std::min(timeout_s, 86400.0) : 10;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds);
  tv.tv_usec = static_cast<suseconds_t>((seconds - std::floor(seconds)) * 1e6);
  setsockopt(conn.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(conn.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (connect(conn.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    return SocketError(socket,
                       "cannot connect (a client of system regions runs on the server's host, "
                       "and for an '@' name in its network namespace)",
                       errno);
  }
  // The hello, or a refusal (the server is busy).
  char in[sizeof(int32_t) + kRegionReplyMaxMessage];
  ssize_t n = recv(conn.get(), in, sizeof(in), 0);
  if (n < 0) return SocketError(socket, "no hello", errno);
  uint32_t magic = 0;
  if (n >= static_cast<ssize_t>(sizeof(magic))) std::memcpy(&magic, in, sizeof(magic));
  if (magic != kRegionSocketMagic) {
    if (n < static_cast<ssize_t>(sizeof(int32_t))) {
      return absl::UnavailableError(
          absl::StrCat("region socket ", socket, ": closed before its hello"));
    }
    absl::Status refused = ReplyStatus(socket, in, static_cast<size_t>(n));
    return refused.ok() ? absl::UnavailableError(absl::StrCat(
                              "region socket ", socket, ": not an attnserve region socket"))
                        : refused;
  }
  RegionSocketHello hello;
  if (n != static_cast<ssize_t>(sizeof(hello))) {
    return absl::UnavailableError(
        absl::StrCat("region socket ", socket, ": a hello of ", n, " bytes, not ", sizeof(hello)));
  }
  std::memcpy(&hello, in, sizeof(hello));
  if (hello.version != kRegionSocketVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("region socket ", socket, ": protocol version ", hello.version,
                     "; this client speaks ", kRegionSocketVersion));
  }
  if (expected_incarnation != 0 && hello.incarnation != expected_incarnation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "region socket ", socket, " answers for server incarnation ", hello.incarnation,
        ", not ", expected_incarnation, " which this client talks to: the server restarted "
        "(ForgetIncarnation once its state is re-created) or another process holds the socket"));
  }
  // The deposit: the token, and the descriptor.
  RegionDepositMessage message;
  std::memcpy(message.claim_token, claim.claim_token.data(), kClaimTokenBytes);
  iovec iov{&message, sizeof(message)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr header{};
  header.msg_iov = &iov;
  header.msg_iovlen = 1;
  header.msg_control = control;
  header.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&header);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  if (sendmsg(conn.get(), &header, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(message))) {
    return SocketError(socket, "cannot send the memfd", errno);
  }
  n = recv(conn.get(), in, sizeof(in), 0);
  if (n < 0) return SocketError(socket, "no answer to the deposit", errno);
  if (n < static_cast<ssize_t>(sizeof(int32_t))) {
    return absl::UnavailableError(
        absl::StrCat("region socket ", socket, ": closed without answering the deposit"));
  }
  if (absl::Status s = ReplyStatus(socket, in, static_cast<size_t>(n)); !s.ok()) return s;
  claim.holder = std::move(conn);
  return claim;
}

}  // namespace attnserve
