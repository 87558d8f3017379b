// A one-thread kernel that keeps the device busy for a while: benchmarks
// launch it ahead of a timed call so that the start event and the call are
// queued behind it, and the events then measure device time alone, without
// the host's launch latency.
#pragma once

#include <cuda_runtime.h>

namespace attnserve {

// Spins for `microseconds` of the device's global timer on `stream`.
cudaError_t LaunchGpuSpin(double microseconds, cudaStream_t stream = nullptr);

}  // namespace attnserve
