// Error handling and allocation for the CUDA backend: every CUDA call is
// checked and turned into an absl::Status that names it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/backend/cuda/staging_packer.h"

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

// cudaMalloc of at least one byte; ResourceExhausted naming `what`, the
// device and its free memory when it does not fit.
absl::Status DeviceAlloc(void** p, int64_t bytes, const char* what, int device);
// cudaMallocHost (pinned) of at least one byte; ResourceExhausted when it
// does not fit.
absl::Status PinnedAlloc(void** p, int64_t bytes, const char* what);

}  // namespace attnserve
