// Device memory a C++ client exports as a CUDA region (docs/transport.md):
// cudaMalloc'ed on one device, exported with cudaIpcGetMemHandle, registered
// with Client::RegisterCudaRegion(name, memory->ipc_handle(), memory->device(),
// memory->size()). Freed when the object goes; unregister the region first.
//
// Built only with the CUDA toolkit (the attnserve_client_cuda library; the
// plain client library needs no CUDA). Every CUDA failure comes back as a
// status naming the call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace attnserve {

class CudaMemory {
 public:
  // `bytes` of device memory on `device`, filled with `fill` bytes.
  static absl::StatusOr<std::unique_ptr<CudaMemory>> Create(int device, int64_t bytes,
                                                            uint8_t fill = 0);
  ~CudaMemory();
  CudaMemory(const CudaMemory&) = delete;
  CudaMemory& operator=(const CudaMemory&) = delete;

  // The 64 bytes of its cudaIpcMemHandle_t.
  const std::string& ipc_handle() const { return handle_; }
  int device() const { return device_; }
  int64_t size() const { return bytes_; }
  void* data() const { return data_; }

  // Host to device and back, [offset, offset + bytes) of this memory;
  // InvalidArgument past its end.
  absl::Status CopyIn(int64_t offset, const void* src, int64_t bytes);
  absl::Status CopyOut(int64_t offset, void* dst, int64_t bytes) const;
  // Sets [offset, offset + bytes) to `value` bytes (e.g. 0xff: NaN halves).
  absl::Status Fill(int64_t offset, int64_t bytes, uint8_t value);

 private:
  CudaMemory(int device, int64_t bytes, void* data, std::string handle)
      : device_(device), bytes_(bytes), data_(data), handle_(std::move(handle)) {}
  absl::Status CheckRange(const char* what, int64_t offset, int64_t bytes) const;

  int device_;
  int64_t bytes_;
  void* data_;
  std::string handle_;
};

}  // namespace attnserve
