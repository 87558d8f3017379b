#include "server/backend/cuda/cuda_util.h"

#include <algorithm>

namespace attnserve {

absl::Status DeviceAlloc(void** p, int64_t bytes, const char* what, int device) {
  const cudaError_t err = cudaMalloc(p, std::max<int64_t>(bytes, 1));
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes of device memory for ",
                                                     what, " on device ", device, " (", free_b,
                                                     " bytes free of ", total_b, ")"));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(err);
  return absl::OkStatus();
}

absl::Status PinnedAlloc(void** p, int64_t bytes, const char* what) {
  const cudaError_t err = cudaMallocHost(p, std::max<int64_t>(bytes, 1));
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes of pinned host memory for ", what));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(err);
  return absl::OkStatus();
}

}  // namespace attnserve
