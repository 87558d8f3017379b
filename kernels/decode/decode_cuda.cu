// Launch and dispatch of the decode family (kernels/decode/decode_kernel.cuh):
// per-device attributes, cluster launches, occupancy, and the (head_dim,
// tile_rows, dtype, FP8 format) switch behind kernels/decode/decode_cuda.h.
#include "kernels/decode/decode_cuda.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/decode/decode_kernel.cuh"
#include "kernels/per_device.h"

namespace attnserve {
namespace {

using decode::DecodeKernelArgs;
using decode::DecodeTraits;
using decode::PagedDecodeKernel;

// The kernel's attributes: its shared memory, and non-portable cluster
// sizes (up to 16 CTAs; sm_90+, where cluster mode runs).
template <int D, int MT, typename T, int F8, bool kFour = false>
cudaError_t ConfigureDecode() {
  using Tr = DecodeTraits<D, MT, F8 != 0, kFour>;
  auto kernel = PagedDecodeKernel<D, MT, T, F8, kFour>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
  if (err != cudaSuccess) return err;
  int dev = 0, major = 0;
  if ((err = cudaGetDevice(&dev)) != cudaSuccess) return err;
  if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev)) != cudaSuccess) return err;
  if (major >= 9) return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  return cudaSuccess;
}

template <int D, int MT, typename T, int F8, bool kFour>
cudaError_t LaunchDecodeKernel(const DecodeKernelArgs& args, int32_t num_items, cudaStream_t stream) {
  using Tr = DecodeTraits<D, MT, F8 != 0, kFour>;
  auto kernel = PagedDecodeKernel<D, MT, T, F8, kFour>;
  // The attributes are per device (kernels/per_device.h).
  static PerDeviceOnce configured;
  const cudaError_t err = configured.Run(ConfigureDecode<D, MT, T, F8, kFour>);
  if (err != cudaSuccess) return err;
  if (args.cluster <= 1) {
    kernel<<<num_items, Tr::kThreads, Tr::kSmemBytes, stream>>>(args);
    return cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(num_items));
  cfg.blockDim = dim3(Tr::kThreads);
  cfg.dynamicSmemBytes = Tr::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(args.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args);
}

// Resident CTAs per SM of the kernel on the current device.
template <int D, int MT, typename T, int F8, bool kFour = false>
int32_t CtasPerSm() {
  using Tr = DecodeTraits<D, MT, F8 != 0, kFour>;
  auto kernel = PagedDecodeKernel<D, MT, T, F8, kFour>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Tr::kThreads, Tr::kSmemBytes) != cudaSuccess) {
    cudaGetLastError();
    return 1;
  }
  return std::max(n, 1);
}

// FP8 pools at head_dim 128 with one m-tile have a second kernel, compiled
// for four CTAs an SM with one ring stage fewer (DecodeTraits' kFour). It
// streams less per CTA: on the H200 it lost 6-7% where the three-CTA
// kernel's slots hold every item (64 x 2k / 4k / 8k, 256 items) and won
// 3-7% at 256 x 4k (1,024 items: 2.6 waves of three CTAs an SM, 1.9 of
// four; bench/results/2026-12-04-session25-h200.md). So it is the family's
// wide kernel: it runs when the launch has more items than the three-CTA
// kernel's resident slots and the device holds more of its CTAs an SM
// (four: -1; both asked once per device), or as `four` forces it (0 / 1);
// never in cluster mode. The plan prices it the same way
// (DecodePlanOptions::wide_ctas_per_sm).
//
// WideCtasPerSm: the wide kernel's resident CTAs an SM where the device
// holds more of them than of the other's; 0 where there is none.
template <int D, int MT, typename T, int F8>
int32_t WideCtasPerSm() {
  if constexpr (decode::DecodeHasWideKernel(D, MT, F8 != 0)) {
    static PerDeviceInt wide;
    return wide.Get([] {
      const int32_t four = CtasPerSm<D, MT, T, F8, true>();
      return four > CtasPerSm<D, MT, T, F8, false>() ? four : int32_t{0};
    });
  }
  return 0;
}

template <int D, int MT, typename T, int F8>
cudaError_t LaunchDecode(const DecodeKernelArgs& args, int32_t num_items, cudaStream_t stream, int32_t four) {
  if constexpr (decode::DecodeHasWideKernel(D, MT, F8 != 0)) {
    // Items above which the four-CTA kernel runs (INT32_MAX: never).
    static PerDeviceInt four_above;
    bool use = four > 0;
    if (four < 0) {
      use = num_items > four_above.Get([] {
        int dev = 0, sms = 0;
        if (WideCtasPerSm<D, MT, T, F8>() == 0 || cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
          cudaGetLastError();
          return int32_t{INT32_MAX};
        }
        return CtasPerSm<D, MT, T, F8, false>() * sms;
      });
    }
    if (use && args.cluster <= 1) return LaunchDecodeKernel<D, MT, T, F8, true>(args, num_items, stream);
  }
  return LaunchDecodeKernel<D, MT, T, F8, false>(args, num_items, stream);
}

// Largest cluster (<= kMaxDecodeCluster) the device co-schedules for this
// kernel; 0 below sm_90.
template <int D, int MT, typename T, int F8>
int32_t MaxCluster() {
  using Tr = DecodeTraits<D, MT, F8 != 0>;
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess || major < 9 ||
      ConfigureDecode<D, MT, T, F8>() != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kMaxDecodeCluster);
  cfg.blockDim = dim3(Tr::kThreads);
  cfg.dynamicSmemBytes = Tr::kSmemBytes;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kMaxDecodeCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxPotentialClusterSize(&n, PagedDecodeKernel<D, MT, T, F8>, &cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return std::min<int32_t>(n, kMaxDecodeCluster);
}


// (head_dim, tile_rows, dtype) -> the kernel's constants. Invalid pairs
// return cudaErrorInvalidValue (for CtasPerSm: 1) through FALLBACK.
#define ATTNSERVE_DISPATCH_DECODE_T(head_dim, tile_rows, FALLBACK, FN, ...)     \
  if ((head_dim) == 64 && (tile_rows) == 16) return FN<64, 1, T, F8>(__VA_ARGS__);   \
  if ((head_dim) == 64 && (tile_rows) == 32) return FN<64, 2, T, F8>(__VA_ARGS__);   \
  if ((head_dim) == 128 && (tile_rows) == 16) return FN<128, 1, T, F8>(__VA_ARGS__); \
  if ((head_dim) == 128 && (tile_rows) == 32) return FN<128, 2, T, F8>(__VA_ARGS__); \
  if ((head_dim) == 256 && (tile_rows) == 16) return FN<256, 1, T, F8>(__VA_ARGS__); \
  return FALLBACK
#define ATTNSERVE_DISPATCH_DECODE_F8(head_dim, tile_rows, kv_fp8, FALLBACK, FN, ...)  \
  if ((kv_fp8) == Fp8Format::kE4m3) {                                                \
    constexpr int F8 = static_cast<int>(Fp8Format::kE4m3);                           \
    ATTNSERVE_DISPATCH_DECODE_T(head_dim, tile_rows, FALLBACK, FN, __VA_ARGS__);     \
  } else if ((kv_fp8) == Fp8Format::kE5m2) {                                         \
    constexpr int F8 = static_cast<int>(Fp8Format::kE5m2);                           \
    ATTNSERVE_DISPATCH_DECODE_T(head_dim, tile_rows, FALLBACK, FN, __VA_ARGS__);     \
  } else {                                                                           \
    constexpr int F8 = 0;                                                            \
    ATTNSERVE_DISPATCH_DECODE_T(head_dim, tile_rows, FALLBACK, FN, __VA_ARGS__);     \
  }
// (head_dim, tile_rows, dtype, kv_fp8): kv_fp8 the pools' FP8 format
// (Fp8Format::kNone: 16-bit pools of dtype).
#define ATTNSERVE_DISPATCH_DECODE(head_dim, tile_rows, dtype, kv_fp8, FALLBACK, FN, ...)    \
  [&]() {                                                                                  \
    if ((dtype) == KvDType::kBf16) {                                                       \
      using T = __nv_bfloat16;                                                             \
      ATTNSERVE_DISPATCH_DECODE_F8(head_dim, tile_rows, kv_fp8, FALLBACK, FN, __VA_ARGS__); \
    } else {                                                                               \
      using T = __half;                                                                    \
      ATTNSERVE_DISPATCH_DECODE_F8(head_dim, tile_rows, kv_fp8, FALLBACK, FN, __VA_ARGS__); \
    }                                                                                      \
  }()

}  // namespace

int32_t DecodeCtasPerSm(int32_t head_dim, KvDType dtype, int32_t tile_rows, Fp8Format kv_fp8) {
  return ATTNSERVE_DISPATCH_DECODE(head_dim, tile_rows, dtype, kv_fp8, int32_t{1}, CtasPerSm);
}

int32_t DecodeWideCtasPerSm(int32_t head_dim, KvDType dtype, int32_t tile_rows, Fp8Format kv_fp8) {
  return ATTNSERVE_DISPATCH_DECODE(head_dim, tile_rows, dtype, kv_fp8, int32_t{0}, WideCtasPerSm);
}

int32_t DecodeMaxCluster(int32_t head_dim, KvDType dtype, int32_t tile_rows, Fp8Format kv_fp8) {
  return ATTNSERVE_DISPATCH_DECODE(head_dim, tile_rows, dtype, kv_fp8, int32_t{0}, MaxCluster);
}

cudaError_t PagedDecodeCuda(const PagedPrefillParams& params, int32_t tile_rows, const DecodeWorkItem* items,
                            int32_t num_items, float* part_o, float* part_lse, int32_t* counters,
                            cudaStream_t stream, const DecodeLaunchOptions& options) {
  const KvGeometry& geo = params.geo;
  if (!DecodeGeometrySupported(geo)) return cudaErrorInvalidValue;
  if (tile_rows != DecodeTileRows(geo.head_dim, tile_rows)) return cudaErrorInvalidValue;
  if (num_items < 0) return cudaErrorInvalidValue;
  if (num_items == 0) return cudaSuccess;
  if (geo.SlotsPerLayer() > INT32_MAX) return cudaErrorInvalidValue;  // the kernel's slots are 31-bit
  if (options.cluster > kMaxDecodeCluster || (options.cluster > 1 && num_items % options.cluster != 0)) {
    return cudaErrorInvalidValue;
  }
  DecodeKernelArgs args;
  args.p = params;
  args.items = items;
  args.part_o = part_o;
  args.part_lse = part_lse;
  args.counters = counters;
  args.skip_merge = options.skip_merge ? 1 : 0;
  args.cluster = options.cluster;
  args.slots_per_layer = geo.SlotsPerLayer();
  args.page = FastDiv(geo.page_size);
  args.trace = options.trace;
  return ATTNSERVE_DISPATCH_DECODE(geo.head_dim, tile_rows, geo.dtype, geo.kv_fp8, cudaErrorInvalidValue,
                                   LaunchDecode, args, num_items, stream, options.four_ctas);
}

}  // namespace attnserve
