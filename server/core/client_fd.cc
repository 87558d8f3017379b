#include "server/core/client_fd.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <system_error>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {
namespace {

// SCM_MAX_FD: the most descriptors one message carries. A receive with room
// for fewer would have the kernel close the rest on the receiving thread.
constexpr int kMaxFdsPerMessage = 253;
// Connections found inside a connection's queue are disarmed this deep; the
// ones deeper are closed as they are.
constexpr int kMaxDepth = 4;
// Messages received from one connection before it is closed as it is.
constexpr int kMaxMessages = 4096;

struct Closers {
  absl::Mutex mu;
  std::deque<int> queue ABSL_GUARDED_BY(mu);
  int threads ABSL_GUARDED_BY(mu) = 0;
  int idle ABSL_GUARDED_BY(mu) = 0;
  int64_t closing ABSL_GUARDED_BY(mu) = 0;  // queued or being closed
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !queue.empty(); }
};

// Never destroyed: detached closer threads use it until the process ends.
Closers& TheClosers() {
  static Closers* closers = new Closers;
  return *closers;
}

// Takes out of `fd` what would make its close block, where that can be done:
// a socket closes at once (no lingering over unsent data); a Unix socket
// takes no more messages, and the descriptors queued in it are received and
// closed here, each disarmed in turn.
void Disarm(int fd, int depth) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return;
  const linger at_once{1, 0};
  (void)setsockopt(fd, SOL_SOCKET, SO_LINGER, &at_once, sizeof(at_once));
  int domain = 0;
  socklen_t len = sizeof(domain);
  if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0 || domain != AF_UNIX) return;
  (void)shutdown(fd, SHUT_RD);
  for (int m = 0; m < kMaxMessages; ++m) {
    char data[256];
    iovec iov{data, sizeof(data)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
    msghdr header{};
    header.msg_iov = &iov;
    header.msg_iovlen = 1;
    header.msg_control = control;
    header.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(fd, &header, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;  // nothing queued (EAGAIN), or not readable
    bool carried = false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&header); c != nullptr; c = CMSG_NXTHDR(&header, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t k = 0; k < count; ++k) {
        int got;
        std::memcpy(&got, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
        if (depth < kMaxDepth) Disarm(got, depth + 1);
        close(got);
        carried = true;
      }
    }
    if (n == 0 && !carried) return;  // the end of the queue
  }
}

void CloserLoop() {
  Closers& c = TheClosers();
  for (;;) {
    int fd;
    {
      absl::MutexLock lock(&c.mu);
      ++c.idle;
      c.mu.Await(absl::Condition(&c, &Closers::HasWork));
      --c.idle;
      fd = c.queue.front();
      c.queue.pop_front();
    }
    Disarm(fd, 0);
    close(fd);
    absl::MutexLock lock(&c.mu);
    --c.closing;
  }
}

}  // namespace

void CloseClientFd(int fd) {
  if (fd < 0) return;
  Closers& c = TheClosers();
  bool start = false;
  {
    absl::MutexLock lock(&c.mu);
    c.queue.push_back(fd);
    ++c.closing;
    if (c.idle == 0 && c.threads < kMaxClosers) {
      ++c.threads;
      start = true;
    }
  }
  if (!start) return;
  try {
    std::thread(CloserLoop).detach();
  } catch (const std::system_error&) {
    // No thread now: the descriptor waits for a closer started later.
    absl::MutexLock lock(&c.mu);
    --c.threads;
  }
}

int64_t ClientFdsClosing() {
  Closers& c = TheClosers();
  absl::MutexLock lock(&c.mu);
  return c.closing;
}

}  // namespace attnserve
