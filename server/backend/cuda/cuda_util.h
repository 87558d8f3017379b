// Error handling and allocation for the CUDA backend: every CUDA call is
// checked and turned into an absl::Status that names it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve {

// Evaluates a CUDA call; on failure returns absl::InternalError naming it.
#define ATTNSERVE_CUDA_RETURN_IF_ERROR(expr)                                            \
  do {                                                                                  \
    const cudaError_t cuda_err_ = (expr);                                               \
    if (cuda_err_ != cudaSuccess) {                                                     \
      return absl::InternalError(absl::StrCat(#expr, ": ", cudaGetErrorName(cuda_err_), \
                                              " (", cudaGetErrorString(cuda_err_), ")")); \
    }                                                                                   \
  } while (0)

// Rounds up to the staging alignment (256 bytes: every packed array starts on
// a boundary any vector load accepts).
inline constexpr int64_t kStagingAlign = 256;
inline int64_t AlignUp(int64_t x) { return (x + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

// cudaMalloc of at least one byte; ResourceExhausted naming `what`, the
// device and its free memory when it does not fit.
absl::Status DeviceAlloc(void** p, int64_t bytes, const char* what, int device);
// cudaMallocHost (pinned) of at least one byte; ResourceExhausted when it
// does not fit.
absl::Status PinnedAlloc(void** p, int64_t bytes, const char* what);

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
