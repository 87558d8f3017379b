#include "client/cuda_memory.h"

#include <cuda_runtime.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

absl::Status CudaStatus(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear it, so that the next call does not report it again
  return absl::InternalError(absl::StrCat(call, ": ", cudaGetErrorString(err)));
}

// Makes `device` current for its scope and then restores the caller's
// device: a CudaMemory call leaves the calling thread's current device as it
// found it.
class OnDevice {
 public:
  explicit OnDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    status_ = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
  }
  ~OnDevice() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaMemory>> CudaMemory::Create(int device, int64_t bytes,
                                                               uint8_t fill) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("CudaMemory: bytes must be > 0, got ", bytes));
  }
  int count = 0;
  absl::Status s = CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (!s.ok()) return s;
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CudaMemory: device must be in [0, ", count,
                                                   "), got ", device));
  }
  OnDevice on(device);
  if (!on.status().ok()) return on.status();
  void* data = nullptr;
  if (s = CudaStatus(cudaMalloc(&data, bytes), "cudaMalloc"); !s.ok()) return s;
  cudaIpcMemHandle_t handle;
  s = CudaStatus(cudaMemset(data, fill, bytes), "cudaMemset");
  if (s.ok()) s = CudaStatus(cudaIpcGetMemHandle(&handle, data), "cudaIpcGetMemHandle");
  if (!s.ok()) {
    cudaFree(data);
    return s;
  }
  return std::unique_ptr<CudaMemory>(
      new CudaMemory(device, bytes, data,
                     std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))));
}

CudaMemory::~CudaMemory() {
  OnDevice on(device_);
  cudaFree(data_);
}

absl::Status CudaMemory::CheckRange(const char* what, int64_t offset, int64_t bytes) const {
  if (offset < 0 || bytes < 0 || offset > bytes_ || bytes > bytes_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("CudaMemory::", what, ": [", offset, ", ",
                                                   offset, " + ", bytes, ") is outside [0, ",
                                                   bytes_, ")"));
  }
  return absl::OkStatus();
}

absl::Status CudaMemory::CopyIn(int64_t offset, const void* src, int64_t bytes) {
  if (absl::Status s = CheckRange("CopyIn", offset, bytes); !s.ok()) return s;
  OnDevice on(device_);
  if (!on.status().ok()) return on.status();
  return CudaStatus(
      cudaMemcpy(static_cast<char*>(data_) + offset, src, bytes, cudaMemcpyHostToDevice),
      "cudaMemcpy (host to device)");
}

absl::Status CudaMemory::CopyOut(int64_t offset, void* dst, int64_t bytes) const {
  if (absl::Status s = CheckRange("CopyOut", offset, bytes); !s.ok()) return s;
  OnDevice on(device_);
  if (!on.status().ok()) return on.status();
  return CudaStatus(
      cudaMemcpy(dst, static_cast<const char*>(data_) + offset, bytes, cudaMemcpyDeviceToHost),
      "cudaMemcpy (device to host)");
}

absl::Status CudaMemory::Fill(int64_t offset, int64_t bytes, uint8_t value) {
  if (absl::Status s = CheckRange("Fill", offset, bytes); !s.ok()) return s;
  OnDevice on(device_);
  if (!on.status().ok()) return on.status();
  return CudaStatus(cudaMemset(static_cast<char*>(data_) + offset, value, bytes), "cudaMemset");
}

}  // namespace attnserve
