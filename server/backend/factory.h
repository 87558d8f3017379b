// Picks and builds the backend named by --backend (auto, cuda, cpu).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"
#include "server/backend/options.h"

namespace attnserve {


// True when this build has the CUDA backend and a CUDA device is visible.
bool CudaDevicePresent();

// Bytes of one page across all layers, K and V (for --kv_cache_bytes).
int64_t BytesPerPage(const KvGeometry& geo);

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options);

}  // namespace attnserve
