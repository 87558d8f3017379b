#include "server/backend/cuda/cuda_region_device.h"

#include <cuda.h>  // types of the driver entry point only: no libcuda link
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/cuda_util.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// cuMemGetAddressRange through the runtime's driver entry point (no link
// against libcuda): the size of the allocation that holds `p`, or -1 when it
// cannot be asked.
int64_t AllocationBytes(void* p) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange get_range = []() -> GetRange {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return reinterpret_cast<GetRange>(fn);
  }();
  if (get_range == nullptr) return -1;
  CUdeviceptr base = 0;
  size_t bytes = 0;
  if (get_range(&base, &bytes, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) return -1;
  return static_cast<int64_t>(bytes - (reinterpret_cast<CUdeviceptr>(p) - base));
}

// System regions are page-locked once when registered, so that downloads
// land in them directly (PrefillTask::out_pinned) as in the pinned response
// buffers. A region that cannot be locked still works, through staging.
//
// CUDA regions: the IPC handle is opened once on the server's device with
// peer access enabled lazily, so a region exported on another GPU is copied
// device to device over NVLink (or PCIe peer-to-peer). The same handle
// registered twice (two regions of one allocation, as torch's caching
// allocator makes them) is opened once and reference-counted: the driver
// allows one mapping of an allocation per process and device.
class CudaRegionDevice final : public RegionDevice {
 public:
  explicit CudaRegionDevice(int device) : device_(device) {}

  absl::StatusOr<void*> OpenIpc(absl::string_view handle, int32_t device_id, int64_t bytes) override {
    const int count = CudaDeviceCount();
    if (device_id < 0 || device_id >= count) {
      return absl::InvalidArgumentError(absl::StrCat("cuda.device_id=", device_id, " out of range [0, ",
                                                     count, "): the CUDA devices this server sees"));
    }
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat("cuda.ipc_handle has ", handle.size(),
                                                     " bytes: a cudaIpcMemHandle_t has ",
                                                     sizeof(cudaIpcMemHandle_t)));
    }
    absl::MutexLock lock(&mu_);
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (device_id != device_) {
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, device_, device_id) != cudaSuccess) cudaGetLastError();
      if (!can) {
        return absl::FailedPreconditionError(absl::StrCat(
            "cuda.device_id=", device_id, ": the server's device ", device_,
            " has no peer access to it (a cuda region must be on the server's device or a peer)"));
      }
    }
    std::string key(handle);
    void* p = nullptr;
    auto it = open_.find(key);
    if (it != open_.end()) {
      p = it->second.ptr;
    } else {
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handle.data(), sizeof(h));
      const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      if (err != cudaSuccess) {
        cudaGetLastError();  // not sticky: clear it
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda.ipc_handle does not open on device ", device_, ": ", cudaGetErrorName(err), " (",
            cudaGetErrorString(err), "); it must come from cudaIpcGetMemHandle in a live process"));
      }
    }
    // The allocation's size against what the request claims. (Its device
    // cannot be checked: pointer attributes of an imported mapping name the
    // importing device, so device_id is taken as the client states it.)
    absl::Status bad;
    const int64_t alloc = AllocationBytes(p);
    if (alloc >= 0 && bytes > alloc) {
      bad = absl::InvalidArgumentError(absl::StrCat("cuda.byte_size=", bytes,
                                                    " exceeds the allocation cuda.ipc_handle exports (",
                                                    alloc, " bytes)"));
    }
    if (!bad.ok()) {
      if (it == open_.end() && cudaIpcCloseMemHandle(p) != cudaSuccess) cudaGetLastError();
      return bad;
    }
    if (it != open_.end()) {
      it->second.refs += 1;
    } else {
      open_.emplace(std::move(key), Opened{p, 1});
    }
    return p;
  }

  void CloseIpc(void* device_ptr) override {
    absl::MutexLock lock(&mu_);
    for (auto it = open_.begin(); it != open_.end(); ++it) {
      if (it->second.ptr != device_ptr) continue;
      if (--it->second.refs == 0) {
        cudaSetDevice(device_);
        // Nothing uses the memory any more: every request that named it has
        // completed (its copies were synchronized before it finished).
        if (cudaIpcCloseMemHandle(device_ptr) != cudaSuccess) cudaGetLastError();
        open_.erase(it);
      }
      return;
    }
  }

  bool RegisterHost(void* data, int64_t bytes) override {
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) err = cudaHostRegister(data, size_t(bytes), cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      spdlog::warn("cudaHostRegister of a {}-byte region failed ({}); it is used through staging",
                   bytes, cudaGetErrorString(err));
      return false;
    }
    return true;
  }
  void UnregisterHost(void* data) override {
    cudaSetDevice(device_);
    if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
  }

 private:
  struct Opened {
    void* ptr = nullptr;
    int32_t refs = 0;
  };
  const int device_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Opened> open_ ABSL_GUARDED_BY(mu_);  // by handle bytes
};

}  // namespace

std::unique_ptr<RegionDevice> MakeCudaRegionDevice(int device) {
  return std::make_unique<CudaRegionDevice>(device);
}

}  // namespace attnserve
