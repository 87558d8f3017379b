// Shared memory (sealed memfds) and region references for the integration tests of
// regions and request channels (regions_test.cc, channel_test.cc).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"
#include "client/shared_memory.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace shm_test {

// A memfd name no other test uses (the name is only shown by ListRegions).
inline std::string Name(const std::string& what) {
  static int counter = 0;
  return absl::StrCat("attn_it_", getpid(), "_", what, "_", counter++);
}

// A new sealed memfd of `bytes` (null after a failed expectation).
inline std::unique_ptr<SharedMemory> MakeShm(const std::string& what, int64_t bytes) {
  auto shm = SharedMemory::Create(Name(what), bytes);
  EXPECT_TRUE(shm.ok()) << shm.status();
  return shm.ok() ? *std::move(shm) : nullptr;
}

inline v1::RegionRef Ref(const std::string& name, int64_t offset, int64_t bytes) {
  v1::RegionRef r;
  r.set_name(name);
  r.set_offset(offset);
  r.set_byte_size(bytes);
  return r;
}

}  // namespace shm_test
}  // namespace attnserve
