#include "server/region_socket/region_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/region_socket.h"
#include "server/core/client_fd.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// SCM_MAX_FD: room for every descriptor a message can carry, so that the
// kernel closes none of them on this thread (a close may block: ClientFd).
// A deposit carries one; more are refused, and closed by the closers.
constexpr int kMaxFdsPerMessage = 253;
constexpr absl::Duration kExpireEvery = absl::Seconds(1);

// Sends one reply (code, then the message, cut to kRegionReplyMaxMessage).
// Never blocks: a client that does not read its replies loses them.
void Reply(int fd, const absl::Status& status) {
  const int32_t code = static_cast<int32_t>(status.code());
  std::string bytes(sizeof(code), '\0');
  std::memcpy(bytes.data(), &code, sizeof(code));
  const absl::string_view message = status.message().substr(0, kRegionReplyMaxMessage);
  bytes.append(message.data(), message.size());
  (void)send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

// A socket at `addr` that someone still listens on.
bool SomeoneListens(const sockaddr_un& addr, socklen_t len) {
  UniqueFd probe(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!probe.valid()) return false;
  return connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr), len) == 0 ||
         errno != ECONNREFUSED;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegionSocket>> RegionSocket::Start(
    const RegionSocketOptions& options, AttentionCore* core) {
  sockaddr_un addr{};
  socklen_t len = 0;
  if (!RegionSocketAddress(options.name, &addr, &len)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--region_socket='", options.name, "' is not a Unix socket name: '@NAME' (abstract, at "
        "most ", sizeof(addr.sun_path) - 1, " bytes after the @) or a path of at most ",
        sizeof(addr.sun_path) - 1, " bytes"));
  }
  std::unique_ptr<RegionSocket> s(new RegionSocket(options, core));
  s->listener_.reset(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  s->wake_.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!s->listener_.valid() || !s->wake_.valid()) {
    return absl::InternalError(absl::StrCat("--region_socket: socket: ", std::strerror(errno)));
  }
  const bool abstract = options.name[0] == '@';
  auto bind_it = [&] {
    return bind(s->listener_.get(), reinterpret_cast<const sockaddr*>(&addr), len) == 0;
  };
  if (!bind_it()) {
    int err = errno;
    if (err == EADDRINUSE && !abstract) {
      // A socket file left by a server that was killed: nobody listens.
      struct stat st {};
      if (lstat(options.name.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) &&
          !SomeoneListens(addr, len) && unlink(options.name.c_str()) == 0) {
        err = bind_it() ? 0 : errno;
      } else if (lstat(options.name.c_str(), &st) == 0 && !S_ISSOCK(st.st_mode)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "--region_socket=", options.name, ": the path exists and is not a socket"));
      }
    }
    if (err == EADDRINUSE) {
      return absl::UnavailableError(absl::StrCat(
          "--region_socket=", options.name, ": the address is already in use (another attnserve "
          "on this host, or another program, listens there); stop it or choose another "
          "--region_socket"));
    }
    if (err != 0) {
      return absl::UnavailableError(
          absl::StrCat("--region_socket=", options.name, ": cannot bind: ", std::strerror(err)));
    }
  }
  s->bound_path_ = !abstract;
  if (listen(s->listener_.get(), 64) != 0) {
    return absl::UnavailableError(
        absl::StrCat("--region_socket=", options.name, ": cannot listen: ", std::strerror(errno)));
  }
  s->thread_ = std::thread([raw = s.get()] { raw->Run(); });
  return s;
}

RegionSocket::~RegionSocket() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)write(wake_.get(), &one, sizeof(one));
    thread_.join();
  }
  listener_.reset();
  if (bound_path_) unlink(options_.name.c_str());
}

void RegionSocket::Run() {
  struct Pending {
    ClientFd fd;  // the client can queue descriptors on it
    absl::Time deadline;
  };
  std::vector<Pending> pending;
  std::vector<pollfd> polled;
  absl::Time next_expire = absl::Now() + kExpireEvery;
  // After accept fails for want of descriptors or memory, the listener is
  // left alone for a while rather than polled (it stays readable) in a loop.
  absl::Time listen_again = absl::InfinitePast();
  for (;;) {
    const absl::Time start = absl::Now();
    const bool listening = listen_again <= start;
    absl::Time wake_at = listening ? next_expire : std::min(next_expire, listen_again);
    for (const Pending& p : pending) wake_at = std::min(wake_at, p.deadline);
    const int64_t timeout_ms =
        std::clamp<int64_t>(absl::ToInt64Milliseconds(wake_at - start) + 1, 0, 1000);
    polled.clear();
    polled.push_back({wake_.get(), POLLIN, 0});
    polled.push_back({listening ? listener_.get() : -1, POLLIN, 0});
    for (const Pending& p : pending) polled.push_back({p.fd.get(), POLLIN, 0});
    if (poll(polled.data(), polled.size(), static_cast<int>(timeout_ms)) < 0 && errno != EINTR) {
      spdlog::error("region socket: poll failed ({}); it stops taking regions",
                    std::strerror(errno));
      return;
    }
    if (polled[0].revents != 0) return;  // stopping
    const absl::Time now = absl::Now();

    // Deposits (or hang-ups) of the connections already accepted.
    std::vector<Pending> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      if (polled[i + 2].revents == 0) {
        if (now < p.deadline) {
          still.push_back(std::move(p));
        } else {
          Reply(p.fd.get(), absl::DeadlineExceededError(absl::StrCat(
                                "no deposit within ", absl::FormatDuration(
                                                          options_.connection_timeout),
                                " of connecting")));
        }
        continue;
      }
      RegionDepositMessage message;
      char buffer[sizeof(message) + 1];
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
      iovec iov{buffer, sizeof(buffer)};
      msghdr header{};
      header.msg_iov = &iov;
      header.msg_iovlen = 1;
      header.msg_control = control;
      header.msg_controllen = sizeof(control);
      const ssize_t n = recvmsg(p.fd.get(), &header, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
        still.push_back(std::move(p));
        continue;
      }
      std::vector<ClientFd> fds;
      for (cmsghdr* c = n >= 0 ? CMSG_FIRSTHDR(&header) : nullptr; c != nullptr;
           c = CMSG_NXTHDR(&header, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t k = 0; k < count; ++k) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
          fds.emplace_back(fd);
        }
      }
      if (n <= 0 && fds.empty()) continue;  // hung up before depositing: closes
      absl::Status status;
      if ((header.msg_flags & MSG_CTRUNC) != 0 || fds.size() != 1) {
        status = absl::InvalidArgumentError(absl::StrCat(
            "a deposit carries exactly one file descriptor (SCM_RIGHTS), the memfd; this one "
            "carried ", (header.msg_flags & MSG_CTRUNC) != 0 ? "more than " : "",
            fds.size()));
      } else if (n != static_cast<ssize_t>(sizeof(message)) ||
                 (header.msg_flags & MSG_TRUNC) != 0) {
        status = absl::InvalidArgumentError(absl::StrCat(
            "a deposit is ", sizeof(message), " bytes (magic, version, ", kClaimTokenBytes,
            "-byte claim token), not ", (header.msg_flags & MSG_TRUNC) != 0 ? "more than " : "",
            n));
      } else {
        std::memcpy(&message, buffer, sizeof(message));
        if (message.magic != kRegionSocketMagic || message.version != kRegionSocketVersion) {
          status = absl::InvalidArgumentError(absl::StrCat(
              "a deposit starts with magic 0x", absl::Hex(kRegionSocketMagic), " and version ",
              kRegionSocketVersion, ", not 0x", absl::Hex(message.magic), " and ",
              message.version));
        } else {
          RegionDeposit deposit;
          deposit.claim_token.assign(message.claim_token, kClaimTokenBytes);
          deposit.memfd = std::move(fds[0]);
          // The core keeps its own descriptor of the connection: this one
          // closes after the reply.
          deposit.holder.reset(fcntl(p.fd.get(), F_DUPFD_CLOEXEC, 0));
          status = deposit.holder.valid()
                       ? core_->DepositRegion(std::move(deposit))
                       : absl::ResourceExhaustedError(absl::StrCat(
                             "the server cannot keep the connection: ", std::strerror(errno)));
        }
      }
      // The deposit is in the core before the client reads OK, so that the
      // RegisterRegion it sends next finds it.
      Reply(p.fd.get(), status);
      // Kept as the holder, the connection is closed with it; this
      // descriptor is another of the same connection, whose close releases
      // nothing, so it closes here. Refused, it goes to the closers.
      if (status.ok()) close(p.fd.release());
    }
    pending = std::move(still);

    // One new connection per round, after the hang-ups above: a client that
    // closed a connection and then opens another finds its room.
    if (polled[1].revents != 0) {
      ClientFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      RegionSocketHello hello;
      hello.incarnation = options_.incarnation;
      if (!fd.valid()) {
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          spdlog::warn("region socket: cannot accept ({}); not listening for 100 ms",
                       std::strerror(errno));
          listen_again = now + absl::Milliseconds(100);
        }
      } else if (static_cast<int32_t>(pending.size()) >= options_.max_connections) {
        Reply(fd.get(), absl::ResourceExhaustedError(absl::StrCat(
                            "the region socket has ", pending.size(),
                            " connections waiting for their deposit: at most ",
                            options_.max_connections, "; try again")));
      } else if (send(fd.get(), &hello, sizeof(hello), MSG_NOSIGNAL | MSG_DONTWAIT) ==
                 static_cast<ssize_t>(sizeof(hello))) {
        pending.push_back({std::move(fd), now + options_.connection_timeout});
      }
    }

    if (now >= next_expire) {
      core_->ExpireRegionDeposits();
      next_expire = now + kExpireEvery;
    }
  }
}

}  // namespace attnserve
