#include "bench/gpu_spin.h"

#include <cstdint>

namespace attnserve {
namespace {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void SpinKernel(uint64_t ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) {
  }
}

}  // namespace

cudaError_t LaunchGpuSpin(double microseconds, cudaStream_t stream) {
  SpinKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(microseconds * 1e3));
  return cudaGetLastError();
}

}  // namespace attnserve
