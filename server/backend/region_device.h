// RegionDevice: what a backend does with shared-memory regions
// (server/core/region_table.h, docs/transport.md). The defaults are the CPU
// backend's: host memory is used as it is, and CUDA regions are refused.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace attnserve {

class RegionDevice {
 public:
  virtual ~RegionDevice() = default;
  // Page-locks [data, data + bytes) so that the device's copy engines reach
  // it directly; false when that is not done (the region still works: the
  // backend copies through its staging buffers). Thread-safe.
  virtual bool RegisterHost(void* data, int64_t bytes) { return false; }
  // Undoes RegisterHost (called before the memory is unmapped).
  virtual void UnregisterHost(void* data) {}
  // Opens a CUDA IPC handle (64 bytes) on `device_id`; the returned device
  // pointer stays valid until CloseIpc.
  virtual absl::StatusOr<void*> OpenIpc(absl::string_view handle, int32_t device_id,
                                        int64_t bytes) {
    return absl::FailedPreconditionError(
        "cuda regions are not served by this server's backend (CUDA IPC is not implemented "
        "yet)");
  }
  virtual void CloseIpc(void* device_ptr) {}
};

}  // namespace attnserve
