// RegionDevice: what a backend does with shared-memory regions
// (server/core/region_table.h, docs/transport.md, docs/design.md section
// 2.3). The core decides and the backend touches the device: the region
// table validates a RegisterRegion (name, sizes, caps, ownership) and then
// calls these hooks to page-lock a system region or to open a CUDA region's
// IPC handle, and calls the matching undo when the region's last reference
// goes (unregistered and no request in flight). The defaults are a backend
// without a device: host memory is used as it is, and CUDA regions are
// refused.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
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
  // Opens a CUDA IPC handle (the 64 bytes of a cudaIpcMemHandle_t) exported
  // by another process for memory on `device_id` (as this server numbers its
  // devices), of which the region covers the first `bytes`. Returns a
  // pointer the backend's device can copy from and to (device memory,
  // possibly a peer's), valid until CloseIpc. Errors name the field
  // (cuda.ipc_handle, cuda.device_id, cuda.byte_size) and leave nothing
  // open. Thread-safe.
  virtual absl::StatusOr<void*> OpenIpc(absl::string_view handle, int32_t device_id,
                                        int64_t bytes) {
    return absl::FailedPreconditionError(
        "cuda regions are not served by this server's backend: they need the cuda backend");
  }
  // Closes what OpenIpc returned (the last reference to the region went).
  virtual void CloseIpc(void* device_ptr) {}
};

}  // namespace attnserve
