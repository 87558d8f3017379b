// UniqueFd: owns one file descriptor and closes it when it goes (the
// region socket's connections and the memfds of system regions, on the
// server and in the C++ client).
//
//   UniqueFd fd(memfd_create("io", MFD_CLOEXEC | MFD_ALLOW_SEALING));
//   if (!fd.valid()) return ...;
//   SendIt(fd.get());   // still ours; closed when fd goes out of scope
#pragma once

#include <unistd.h>

#include <utility>

namespace attnserve {

// Owns one file descriptor and closes it with Close when it goes (the
// server's ClientFd, server/core/client_fd.h, closes off the caller's thread).
template <void (*Close)(int)>
class BasicFd {
 public:
  BasicFd() = default;
  explicit BasicFd(int fd) : fd_(fd) {}
  BasicFd(BasicFd&& other) noexcept : fd_(other.release()) {}
  BasicFd& operator=(BasicFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  BasicFd(const BasicFd&) = delete;
  BasicFd& operator=(const BasicFd&) = delete;
  ~BasicFd() { reset(); }

  bool valid() const { return fd_ >= 0; }
  int get() const { return fd_; }
  // Gives the descriptor up without closing it.
  int release() { return std::exchange(fd_, -1); }
  // Closes the descriptor held (if any) and holds `fd` instead.
  void reset(int fd = -1) {
    if (fd_ >= 0) Close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

inline void CloseFd(int fd) { close(fd); }
using UniqueFd = BasicFd<CloseFd>;

}  // namespace attnserve
