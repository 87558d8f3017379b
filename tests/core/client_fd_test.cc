// ClientFd / CloseClientFd: a client's descriptors are closed off the
// caller's thread, and what would make the close block is taken out first.
#include "server/core/client_fd.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

// Waits (at most 10 s) until the closers are idle; whether they got there.
bool ClosersIdle() {
  for (int i = 0; i < 10000; ++i) {
    if (ClientFdsClosing() == 0) return true;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return false;
}

// A connected TCP socket whose close() would block for an hour: SO_LINGER
// 3600 s over a send queue its peer never reads. *listener and *peer keep
// the other end open.
int LingeringTcp(int* listener, int* peer) {
  *listener = socket(AF_INET, SOCK_STREAM, 0);
  int small = 4096;
  setsockopt(*listener, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(*listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(*listener, reinterpret_cast<sockaddr*>(&addr), &len);
  EXPECT_EQ(listen(*listener, 1), 0);
  const int sender = socket(AF_INET, SOCK_STREAM, 0);
  setsockopt(sender, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  EXPECT_EQ(connect(sender, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  *peer = accept(*listener, nullptr, nullptr);
  static char chunk[65536];
  while (send(sender, chunk, sizeof(chunk), MSG_DONTWAIT) > 0) {
  }
  const linger hour{1, 3600};
  setsockopt(sender, SOL_SOCKET, SO_LINGER, &hour, sizeof(hour));
  return sender;
}

TEST(ClientFdTest, ALingeringSocketQueuedOnAConnectionIsClosedWithoutBlocking) {
  int listener, peer;
  const int lingering = LingeringTcp(&listener, &peer);
  // The lingering socket queued, unread, on the server's end (ends[0]) of a
  // client's connection: closing that end closes it.
  int ends[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, ends), 0);
  char data[] = "poison";
  iovec iov{data, sizeof(data)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = control;
  m.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &lingering, sizeof(int));
  ASSERT_EQ(sendmsg(ends[1], &m, 0), static_cast<ssize_t>(sizeof(data)));
  close(lingering);  // the queued copy is the only one now
  { ClientFd server_end(ends[0]); }
  // Without the disarming the closer would block in close() for the hour.
  EXPECT_TRUE(ClosersIdle()) << ClientFdsClosing() << " closes still pending";
  // The server's end is closed (the client sees it hang up) and so is the
  // lingering socket (its peer sees the connection end).
  pollfd p{ends[1], POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 10000), 1);
  EXPECT_NE(p.revents & POLLHUP, 0);
  pollfd q{peer, POLLIN, 0};
  EXPECT_EQ(poll(&q, 1, 10000), 1);
  close(ends[1]);
  close(peer);
  close(listener);
}

TEST(ClientFdTest, ALingeringSocketItselfIsClosedWithoutBlocking) {
  int listener, peer;
  CloseClientFd(LingeringTcp(&listener, &peer));
  EXPECT_TRUE(ClosersIdle()) << ClientFdsClosing() << " closes still pending";
  close(peer);
  close(listener);
}

}  // namespace
}  // namespace attnserve
