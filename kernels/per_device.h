// Host-side state kept once per CUDA device, for the kernel families'
// launches: function attributes (dynamic shared memory, cluster sizes) and
// device facts are per device, and asking or setting them on every launch
// adds host calls to each step's latency.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace attnserve {

// Runs an action at most once per device (devices 0..63; on a higher
// ordinal, on every call). Thread-safe; two threads may both run it the
// first time, so the action must be idempotent (setting an attribute is).
class PerDeviceOnce {
 public:
  // configure() -> cudaError_t, run on the current device unless it ran
  // there before with success.
  template <typename F>
  cudaError_t Run(F&& configure) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
    if (bit != 0 && (done_.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
    if ((err = configure()) != cudaSuccess) return err;
    done_.fetch_or(bit, std::memory_order_acq_rel);
    return cudaSuccess;
  }

 private:
  std::atomic<uint64_t> done_{0};
};

// A yes / no fact about a device, asked once per device (devices 0..63; on
// a higher ordinal, on every call). ask() -> bool runs on the current
// device; a failed cudaGetDevice answers false.
class PerDeviceFlag {
 public:
  template <typename F>
  bool Get(F&& ask) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
    if (bit != 0 && (known_.load(std::memory_order_acquire) & bit) != 0) {
      return (yes_.load(std::memory_order_acquire) & bit) != 0;
    }
    const bool yes = ask();
    if (bit != 0) {
      if (yes) yes_.fetch_or(bit, std::memory_order_acq_rel);
      known_.fetch_or(bit, std::memory_order_acq_rel);
    }
    return yes;
  }

 private:
  std::atomic<uint64_t> known_{0}, yes_{0};
};

// A non-negative integer fact about a device, asked once per device
// (devices 0..63; on a higher ordinal, on every call). ask() -> int32_t
// (>= 0) runs on the current device; a failed cudaGetDevice answers 0.
class PerDeviceInt {
 public:
  PerDeviceInt() {
    for (auto& v : values_) v.store(-1, std::memory_order_relaxed);
  }
  template <typename F>
  int32_t Get(F&& ask) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    if (dev < 0 || dev >= kDevices) return ask();
    int32_t v = values_[dev].load(std::memory_order_acquire);
    if (v < 0) {
      v = ask();
      values_[dev].store(v, std::memory_order_release);
    }
    return v;
  }

 private:
  static constexpr int kDevices = 64;
  std::atomic<int32_t> values_[kDevices];
};

}  // namespace attnserve
