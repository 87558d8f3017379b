// Sealed memfds for the core's region and channel tests
// (region_table_test.cc, channel_table_test.cc), deposited into a
// RegionTable as the region socket would: the memfd, a claim token, and the
// server's end of a connection whose client end the test keeps (closing it
// is the client going away).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/region_socket.h"
#include "common/unique_fd.h"
#include "gtest/gtest.h"
#include "server/core/region_table.h"

namespace attnserve {

// A claim token no other call in this process returns.
inline std::string TestToken() {
  static int counter = 0;
  std::string token = absl::StrCat("token-", counter++);
  token.resize(kClaimTokenBytes, '.');
  return token;
}

// A deposit of (a duplicate of) `fd` under `token`; *client_end gets the
// client's end of its holder connection.
inline RegionDeposit MakeDeposit(int fd, const std::string& token, UniqueFd* client_end) {
  int pair[2] = {-1, -1};
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  RegionDeposit d;
  d.claim_token = token;
  d.memfd.reset(fcntl(fd, F_DUPFD_CLOEXEC, 0));
  d.holder.reset(pair[0]);
  client_end->reset(pair[1]);
  return d;
}

class TestShm {
 public:
  static constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

  // A memfd of `bytes` zeros, or random bytes drawn from `random_seed` when
  // given, sealed with `seals`.
  explicit TestShm(int64_t bytes, std::optional<uint64_t> random_seed = std::nullopt,
                   int seals = kSeals)
      : fd_(memfd_create("attn_core_test", MFD_CLOEXEC | MFD_ALLOW_SEALING)), bytes_(bytes) {
    EXPECT_TRUE(fd_.valid());
    EXPECT_EQ(ftruncate(fd_.get(), bytes), 0);
    if (seals != 0) EXPECT_EQ(fcntl(fd_.get(), F_ADD_SEALS, seals), 0);
    // Read-only when the seals forbid writing (then the bytes stay zero).
    const int prot = (seals & F_SEAL_WRITE) != 0 ? PROT_READ : PROT_READ | PROT_WRITE;
    void* data = mmap(nullptr, bytes, prot, MAP_SHARED, fd_.get(), 0);
    EXPECT_NE(data, MAP_FAILED);
    data_ = data == MAP_FAILED ? nullptr : static_cast<char*>(data);
    if (data_ != nullptr && (prot & PROT_WRITE) != 0 && random_seed.has_value()) {
      std::mt19937_64 gen(*random_seed);
      for (int64_t i = 0; i < bytes; ++i) data_[i] = static_cast<char>(gen());
    }
  }
  ~TestShm() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  TestShm(const TestShm&) = delete;
  TestShm& operator=(const TestShm&) = delete;

  int fd() const { return fd_.get(); }
  char* data() const { return data_; }

  // Deposits the memfd into `table` under a fresh token and returns the
  // token (a failed deposit fails the test).
  std::string Deposit(RegionTable& table) {
    const std::string token = TestToken();
    holders_.emplace_back();
    absl::Status s = table.Deposit(MakeDeposit(fd_.get(), token, &holders_.back()));
    EXPECT_TRUE(s.ok()) << s;
    return token;
  }
  // Closes the client's end of every holder: the client went away.
  void HangUp() { holders_.clear(); }

 private:
  UniqueFd fd_;
  int64_t bytes_;
  char* data_;
  std::vector<UniqueFd> holders_;
};

}  // namespace attnserve
