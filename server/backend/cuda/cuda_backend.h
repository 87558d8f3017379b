// CudaBackend: the paged KV pools in GPU memory and the batched attention
// path (one upload, fused appends, one attention launch, one merge launch
// where anything was split, one download). Built with ATTNSERVE_CUDA.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"
#include "server/backend/factory.h"

namespace attnserve {

// Number of CUDA devices visible (0 when none or when the driver is missing).
int CudaDeviceCount();

// Allocates the pools, pinned staging and workspace once; fails cleanly
// (no crash) when the device is missing or memory does not fit.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(const BackendOptions& options);

}  // namespace attnserve
