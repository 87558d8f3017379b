// A POSIX shared-memory object for the core's region and channel tests
// (region_table_test.cc, channel_table_test.cc): created with a unique key,
// mapped read-write, unmapped and unlinked at the end.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attnserve {

class TestShm {
 public:
  // `bytes` zeros, or random bytes drawn from `random_seed` when given.
  explicit TestShm(int64_t bytes, std::optional<uint64_t> random_seed = std::nullopt)
      : key_(absl::StrCat("/attn_core_", getpid(), "_", counter_++)), bytes_(bytes) {
    const int fd = shm_open(key_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    data_ = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    if (random_seed.has_value()) {
      std::mt19937_64 gen(*random_seed);
      for (int64_t i = 0; i < bytes; ++i) data_[i] = static_cast<char>(gen());
    }
  }
  ~TestShm() {
    munmap(data_, bytes_);
    Unlink();
  }
  TestShm(const TestShm&) = delete;
  TestShm& operator=(const TestShm&) = delete;

  // Removes the key (the mapping stays); the destructor's unlink is then a no-op.
  void Unlink() { shm_unlink(key_.c_str()); }
  const std::string& key() const { return key_; }
  char* data() const { return data_; }

 private:
  static inline int counter_ = 0;
  std::string key_;
  int64_t bytes_;
  char* data_;
};

}  // namespace attnserve
