#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace attnserve {

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(const std::string& key,
                                                                   int64_t bytes) {
  if (bytes < 1) return absl::InvalidArgumentError(absl::StrCat("bytes=", bytes, " must be >= 1"));
  const int fd = shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("shm_open ", key, ": ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("ftruncate ", key, " to ", bytes, ": ", std::strerror(err)));
  }
  void* data = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("mmap ", key, ": ", std::strerror(err)));
  }
  std::unique_ptr<SharedMemory> shm(new SharedMemory());
  shm->key_ = key;
  shm->data_ = static_cast<char*>(data);
  shm->size_ = bytes;
  return shm;
}

SharedMemory::~SharedMemory() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(size_));
  if (unlink_) shm_unlink(key_.c_str());
}

}  // namespace attnserve
