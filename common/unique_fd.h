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

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  bool valid() const { return fd_ >= 0; }
  int get() const { return fd_; }
  // Gives the descriptor up without closing it.
  int release() { return std::exchange(fd_, -1); }
  // Closes the descriptor held (if any) and holds `fd` instead.
  void reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace attnserve
