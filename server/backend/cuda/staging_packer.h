// Staging layout helpers shared by the CUDA backend's host code (batch
// packer) and its CUDA code: host-only, so the packer builds and is tested
// without CUDA.
#pragma once

#include <cstdint>

namespace attnserve {

// Rounds up to the staging alignment (256 bytes: every packed array starts on
// a boundary any vector load accepts).
inline constexpr int64_t kStagingAlign = 256;
inline int64_t AlignUp(int64_t x) { return (x + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

// Bump allocator over one staging buffer: the same offsets address the
// pinned host copy and its device mirror, so one copy moves everything.
class StagingPacker {
 public:
  StagingPacker(uint8_t* host, int64_t capacity) : host_(host), capacity_(capacity) {}
  // Reserves bytes; returns the offset or -1 when it does not fit.
  int64_t Take(int64_t bytes) {
    const int64_t off = AlignUp(used_);
    if (off + bytes > capacity_) return -1;
    used_ = off + bytes;
    return off;
  }
  uint8_t* At(int64_t off) const { return host_ + off; }
  int64_t used() const { return used_; }

 private:
  uint8_t* host_;
  int64_t capacity_;
  int64_t used_ = 0;
};

}  // namespace attnserve
