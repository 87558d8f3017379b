// A kernel that runs the sm90 family's conversion of bf16 Q rows to fp16
// (QRowsToHalf, kernels/sm90/fp8_tiles.cuh) on a tile the test gives, for
// fp8_gpu_test.cc's bit-for-bit check of it against its definition.
#include "tests/gpu/q_rows_probe.h"

#include <cuda_bf16.h>

#include "kernels/sm90/fp8_tiles.cuh"
#include "kernels/sm90/traits.cuh"

namespace attnserve {
namespace gpu_test {
namespace {

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNSERVE_PROBE_SM90 1
#else
#define ATTNSERVE_PROBE_SM90 0
#endif

// Two warpgroups, each converting its 64 rows of the 128-row tile, as the
// consumers do.
template <int D>
__global__ void __launch_bounds__(256) QRowsProbeKernel(const uint16_t* in, uint16_t* out, int8_t* exps,
                                                        int negative) {
#if ATTNSERVE_PROBE_SM90
  using Tr = sm90::Traits<D, sm90::Schedule::kOverlap, true, true, true, true, true>;
  __shared__ __align__(1024) uint8_t tile[Tr::kM * D * 2];
  __shared__ int8_t s_exps[Tr::kM];
  const int t = threadIdx.x;
  for (int i = t; i < Tr::kM * Tr::kChunks; i += 256) {
    const int r = i / Tr::kChunks, c = i % Tr::kChunks;
    *reinterpret_cast<uint4*>(tile + sm90::TileOff<Tr::kM>(r, c)) =
        *reinterpret_cast<const uint4*>(in + r * D + c * 8);
  }
  __syncthreads();
  const int wg = t / 128, ct = t % 128;
  sm90::QRowsToHalf<Tr, Tr::kWgRows>(tile, s_exps, wg * Tr::kWgRows, ct / Tr::kChunks, ct % Tr::kChunks,
                                     negative != 0);
  __syncthreads();
  for (int i = t; i < Tr::kM * Tr::kChunks; i += 256) {
    const int r = i / Tr::kChunks, c = i % Tr::kChunks;
    *reinterpret_cast<uint4*>(out + r * D + c * 8) = *reinterpret_cast<const uint4*>(tile + sm90::TileOff<Tr::kM>(r, c));
  }
  if (t < Tr::kM) exps[t] = s_exps[t];
#else
  __trap();
#endif
}

}  // namespace

cudaError_t RunQRowsProbe(int head_dim, const uint16_t* in, uint16_t* out, int8_t* exps, bool negative) {
  if (head_dim == 64) {
    QRowsProbeKernel<64><<<1, 256>>>(in, out, exps, negative ? 1 : 0);
  } else if (head_dim == 128) {
    QRowsProbeKernel<128><<<1, 256>>>(in, out, exps, negative ? 1 : 0);
  } else {
    return cudaErrorInvalidValue;
  }
  const cudaError_t launched = cudaGetLastError();
  return launched != cudaSuccess ? launched : cudaDeviceSynchronize();
}

}  // namespace gpu_test
}  // namespace attnserve
