// N-way merge of attention states (o_i, lse_i) -> (o, lse), one launch.
// Each thread owns 8 elements (16 bytes) of one (token, head) row; the
// threads of a row read its num_states LSEs (L1 broadcast), weigh and sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "kernels/merge_states_cuda.h"
#include "kernels/mma_sm80.cuh"

namespace attnserve {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// VEC: elements per thread, 8 (16-byte accesses) or 1 (any head_dim).
template <typename T, int VEC>
__global__ void __launch_bounds__(256)
    MergeStatesKernel(const void* const* v, const float* const* lse, int32_t num_states,
                      T* v_out, float* lse_out, int64_t rows, int32_t d, int32_t base_e) {
  const int chunks = d / VEC;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t row = idx / chunks;
  if (row >= rows) return;
  const int c = static_cast<int>(idx - row * chunks);
  // LSEs in base 2 for the math.
  const float to2 = base_e ? kLog2e : 1.f;
  float m = -INFINITY;
  for (int s = 0; s < num_states; ++s) m = fmaxf(m, __ldg(lse[s] + row) * to2);
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  float wsum = 0.f;
  if (m != -INFINITY) {
    for (int s = 0; s < num_states; ++s) {
      const float l = __ldg(lse[s] + row) * to2;
      if (l == -INFINITY) continue;
      const float w = exp2f(l - m);
      wsum += w;
      const T* src = static_cast<const T*>(v[s]) + row * d + c * VEC;
      if constexpr (VEC == 8) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += w * mma::ToFloat<T>(e[i]);
      } else {
        acc[0] += w * mma::ToFloat<T>(src[0]);
      }
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  T* dst = v_out + row * d + c * VEC;
  if constexpr (VEC == 8) {
    uint4 raw;
    raw.x = mma::Pack2<T>(acc[0] * inv, acc[1] * inv);
    raw.y = mma::Pack2<T>(acc[2] * inv, acc[3] * inv);
    raw.z = mma::Pack2<T>(acc[4] * inv, acc[5] * inv);
    raw.w = mma::Pack2<T>(acc[6] * inv, acc[7] * inv);
    *reinterpret_cast<uint4*>(dst) = raw;
  } else {
    dst[0] = mma::FromFloat<T>(acc[0] * inv);
  }
  if (c == 0) {
    float out = -INFINITY;
    if (wsum > 0.f) out = (m + log2f(wsum)) * (base_e ? kLn2 : 1.f);
    lse_out[row] = out;
  }
}

template <typename T, int VEC>
cudaError_t Launch(const MergeStatesParams& p, cudaStream_t stream) {
  const int64_t rows = p.n * p.h;
  const int64_t threads = rows * (p.d / VEC);
  if (threads == 0) return cudaSuccess;
  const int64_t blocks = (threads + 255) / 256;
  MergeStatesKernel<T, VEC><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      p.v, p.lse, p.num_states, static_cast<T*>(p.v_out), p.lse_out, rows, p.d, p.lse_base_e);
  return cudaGetLastError();
}

}  // namespace

cudaError_t MergeStatesCuda(const MergeStatesParams& p, cudaStream_t stream) {
  if (p.num_states < 0 || p.d <= 0 || p.h < 0 || p.n < 0) return cudaErrorInvalidValue;
  const bool vec = p.d % 8 == 0;
  if (p.dtype == KvDType::kBf16) {
    return vec ? Launch<__nv_bfloat16, 8>(p, stream) : Launch<__nv_bfloat16, 1>(p, stream);
  }
  return vec ? Launch<__half, 8>(p, stream) : Launch<__half, 1>(p, stream);
}

}  // namespace attnserve
