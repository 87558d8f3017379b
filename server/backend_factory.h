// Picks and builds the backend named by --backend (auto, cuda, cpu).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/kv_geometry.h"
#include "server/backend.h"

namespace attnserve {

struct BackendOptions {
  std::string kind = "auto";  // "auto" (CUDA when a GPU is present), "cuda", "cpu"
  int32_t device = 0;         // CUDA device ordinal
  KvGeometry geometry;        // num_pages already resolved
  // Workspace sizing: the most query rows one batch may hold (a single
  // request larger than max_batch_tokens runs alone, so this is the larger of
  // max_batch_tokens and the rows that fit in max_message_bytes).
  int32_t max_batch_rows = 0;
  // Most KV page indices / appended rows one batch may hold.
  int64_t max_batch_kv_indices = 0;
  int64_t max_batch_append_rows = 0;
};

// True when this build has the CUDA backend and a CUDA device is visible.
bool CudaDevicePresent();

// Bytes of one page across all layers, K and V (for --kv_cache_bytes).
int64_t BytesPerPage(const KvGeometry& geo);

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options);

}  // namespace attnserve
