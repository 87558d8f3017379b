// N-way merge of attention states (o_i, lse_i) -> (o, lse), one launch.
// Each thread owns 8 elements (16 bytes) of one (token, head) row; the
// threads of a row read its num_states LSEs (L1 broadcast), weigh and sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/merge_states_cuda.h"
#include "kernels/mma_sm80.cuh"

namespace attnserve {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr int kMaxStates = 16;

// State pointers travel by value: no dependent pointer loads in the kernel.
struct StatePtrs {
  const void* v[kMaxStates];
  const float* lse[kMaxStates];
};

// VEC: elements per thread, 8 (16-byte accesses) or 1 (any head_dim). All
// LSE loads are issued before the math and all vector loads before the sums,
// so a thread has every state's bytes in flight at once.
template <typename T, int VEC>
__device__ __forceinline__ void Store(T* dst, const float (&acc)[VEC], float inv) {
  if constexpr (VEC == 8) {
    uint4 out;
    out.x = mma::Pack2<T>(acc[0] * inv, acc[1] * inv);
    out.y = mma::Pack2<T>(acc[2] * inv, acc[3] * inv);
    out.z = mma::Pack2<T>(acc[4] * inv, acc[5] * inv);
    out.w = mma::Pack2<T>(acc[6] * inv, acc[7] * inv);
    *reinterpret_cast<uint4*>(dst) = out;
  } else {
    dst[0] = mma::FromFloat<T>(acc[0] * inv);
  }
}

// NS: the number of states when known at compile time (2..4: register
// arrays sized exactly, every load in flight at once), 0: a run-time loop.
template <typename T, int VEC, int NS>
__global__ void __launch_bounds__(256)
    MergeStatesKernel(const StatePtrs ptrs, int32_t num_states, T* v_out, float* lse_out, int64_t rows,
                      int32_t d, int32_t base_e) {
  using Raw = typename std::conditional<VEC == 8, uint4, T>::type;
  const int chunks = d / VEC;
  const int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int64_t row = idx / chunks;
  if (row >= rows) return;
  const int c = static_cast<int>(idx - row * chunks);
  // LSEs in base 2 for the math.
  const float to2 = base_e ? kLog2e : 1.f;
  constexpr int kN = NS > 0 ? NS : 1;
  if constexpr (NS == 0) {
    // Run-time count: one state at a time.
    float m = -INFINITY;
    for (int s = 0; s < num_states; ++s) m = fmaxf(m, __ldg(ptrs.lse[s] + row) * to2);
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
    float wsum = 0.f;
    if (m != -INFINITY) {
      for (int s = 0; s < num_states; ++s) {
        const float ls = __ldg(ptrs.lse[s] + row) * to2;
        if (ls == -INFINITY) continue;
        const float w = exp2f(ls - m);
        wsum += w;
        const Raw raw = __ldg(reinterpret_cast<const Raw*>(static_cast<const T*>(ptrs.v[s]) + row * d + c * VEC));
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += w * mma::ToFloat<T>(e[i]);
      }
    }
    Store<T, VEC>(v_out + row * d + c * VEC, acc, wsum > 0.f ? 1.f / wsum : 0.f);
    if (c == 0) lse_out[row] = wsum > 0.f ? (m + log2f(wsum)) * (base_e ? kLn2 : 1.f) : -INFINITY;
    return;
  }
  float l[kN];
#pragma unroll
  for (int s = 0; s < kN; ++s) l[s] = __ldg(ptrs.lse[s] + row) * to2;
  Raw raw[kN];
#pragma unroll
  for (int s = 0; s < kN; ++s) {
    if (l[s] != -INFINITY) {
      raw[s] = __ldg(reinterpret_cast<const Raw*>(static_cast<const T*>(ptrs.v[s]) + row * d + c * VEC));
    }
  }
  float m = -INFINITY;
#pragma unroll
  for (int s = 0; s < kN; ++s) m = fmaxf(m, l[s]);
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
  float wsum = 0.f;
  if (m != -INFINITY) {
#pragma unroll
    for (int s = 0; s < kN; ++s) {
      if (l[s] == -INFINITY) continue;
      const float w = exp2f(l[s] - m);
      wsum += w;
      const T* e = reinterpret_cast<const T*>(&raw[s]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += w * mma::ToFloat<T>(e[i]);
    }
  }
  Store<T, VEC>(v_out + row * d + c * VEC, acc, wsum > 0.f ? 1.f / wsum : 0.f);
  if (c == 0) {
    float out = -INFINITY;
    if (wsum > 0.f) out = (m + log2f(wsum)) * (base_e ? kLn2 : 1.f);
    lse_out[row] = out;
  }
}

template <typename T, int VEC, int NS>
cudaError_t Launch(const MergeStatesParams& p, cudaStream_t stream) {
  const int64_t rows = p.n * p.h;
  const int64_t threads = rows * (p.d / VEC);
  if (threads == 0) return cudaSuccess;
  StatePtrs ptrs = {};
  for (int s = 0; s < p.num_states; ++s) {
    ptrs.v[s] = p.v[s];
    ptrs.lse[s] = p.lse[s];
  }
  const int64_t blocks = (threads + 255) / 256;
  MergeStatesKernel<T, VEC, NS><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      ptrs, p.num_states, static_cast<T*>(p.v_out), p.lse_out, rows, p.d, p.lse_base_e);
  return cudaGetLastError();
}

}  // namespace

cudaError_t MergeStatesCuda(const MergeStatesParams& p, cudaStream_t stream) {
  if (p.num_states < 0 || p.num_states > kMaxStates || p.d <= 0 || p.h < 0 || p.n < 0) return cudaErrorInvalidValue;
  const bool vec = p.d % 8 == 0;
  if (p.dtype == KvDType::kBf16) {
    if (!vec) return Launch<__nv_bfloat16, 1, 0>(p, stream);
    switch (p.num_states) {
      case 2: return Launch<__nv_bfloat16, 8, 2>(p, stream);
      case 3: return Launch<__nv_bfloat16, 8, 3>(p, stream);
      case 4: return Launch<__nv_bfloat16, 8, 4>(p, stream);
      default: return Launch<__nv_bfloat16, 8, 0>(p, stream);
    }
  }
  if (!vec) return Launch<__half, 1, 0>(p, stream);
  switch (p.num_states) {
    case 2: return Launch<__half, 8, 2>(p, stream);
    case 3: return Launch<__half, 8, 3>(p, stream);
    case 4: return Launch<__half, 8, 4>(p, stream);
    default: return Launch<__half, 8, 0>(p, stream);
  }
}

}  // namespace attnserve
