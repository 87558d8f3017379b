// SharedMemory: a POSIX shared-memory object this process creates and maps,
// for system regions (docs/transport.md).
//
//   auto shm = attnserve::SharedMemory::Create("/my_client_q", 1 << 20);
//   client->RegisterSystemRegion("q", (*shm)->key(), 0, (*shm)->size());
//   std::memcpy((*shm)->data(), q.data(), q_bytes);   // then name {"q", 0, q_bytes}
//
// The object is unlinked and unmapped when the SharedMemory is destroyed; a
// server that mapped it keeps its own mapping (and so the memory) until the
// region is unregistered.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace attnserve {

class SharedMemory {
 public:
  // Creates `key` ("/name"; fails if it exists) of `bytes` bytes, zeroed, and
  // maps it read-write.
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(const std::string& key,
                                                              int64_t bytes);
  ~SharedMemory();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  const std::string& key() const { return key_; }
  char* data() const { return data_; }
  int64_t size() const { return size_; }
  // Keeps the object when destroyed (only the mapping goes).
  void Release() { unlink_ = false; }

 private:
  SharedMemory() = default;
  std::string key_;
  char* data_ = nullptr;
  int64_t size_ = 0;
  bool unlink_ = true;
};

}  // namespace attnserve
