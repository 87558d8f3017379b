// Descriptors a client can influence: what it handed the server over the
// region socket (SCM_RIGHTS) and the server's ends of its connections there,
// on which it can queue more descriptors. Closing one may block for as long
// as the client likes: a TCP socket with SO_LINGER and data its peer never
// reads, a file on a FUSE mount the client serves, or a connection whose
// queue holds such a descriptor (closing it closes them). So the server never
// closes them on a thread that serves anyone: ClientFd hands them to a few
// closer threads (CloseClientFd), which first take the sting out where they
// can (a socket is shut down for reading and its queued descriptors received
// and closed the same way; a socket is set to close at once, without
// lingering). A close that still blocks holds one closer; past kMaxClosers
// blocked ones, later closes wait in a queue (their descriptors stay open)
// until one returns, and the server goes on serving.
#pragma once

#include <cstdint>

#include "common/unique_fd.h"

namespace attnserve {

// Closer threads at most (more start only while every one is busy).
inline constexpr int kMaxClosers = 8;

// Closes `fd` (>= 0) on a closer thread; returns at once.
void CloseClientFd(int fd);

// Descriptors queued or being closed by the closers (for tests and logs).
int64_t ClientFdsClosing();

// As UniqueFd (common/unique_fd.h), but closed by CloseClientFd.
using ClientFd = BasicFd<CloseClientFd>;

}  // namespace attnserve
