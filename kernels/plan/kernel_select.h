// Which prefill kernel runs a batch: the named kernels of every family, their
// tile shapes, and the heuristic that picks one per batch. Plain C++ (no
// CUDA), unit-tested in tests/kernels/kernel_select_test.cc.
//
// A family is a folder under kernels/ (kernels/sm80/ today). Adding one is a
// new enum value here, its tile rows in PrefillTileRows, one line in
// ChoosePrefillKernel, and one case in kernels/prefill_cuda.cu's dispatch
// (docs/design.md section 2.4).
#pragma once

#include <cstdint>

#include "common/kv_geometry.h"

namespace attnserve {

enum class PrefillKernel : int32_t {
  // mma.sync (sm_80+), the widest tile head_dim allows: 128 packed query rows
  // (two 16-row MMA tiles per warp) at head_dim 64 and 128, 64 at 256.
  kSm80,
  // mma.sync, 64-row tiles (one MMA tile per warp) at head_dim 128: for
  // batches whose every sequence packs at most 64 rows (decode-sized), where
  // a 128-row tile would be half empty.
  kSm80Rows64,
};
inline constexpr int kNumPrefillKernels = 2;

// Stable lower-case name, used as the `kernel` label value's suffix in
// metrics and in benchmark output: "sm80", "sm80_rows64".
const char* PrefillKernelName(PrefillKernel kernel);

// Packed query rows per tile (the plan's tile_rows).
int32_t PrefillTileRows(PrefillKernel kernel, int32_t head_dim);

// What the heuristic knows about the device.
struct PrefillDevice {
  int32_t sm_major = 8;  // compute capability
  int32_t sm_minor = 0;
};

// The kernel for a batch whose longest sequence packs max_packed_rows rows
// (q_len * num_qo_heads / num_kv_heads).
PrefillKernel ChoosePrefillKernel(const KvGeometry& geo, const PrefillDevice& device,
                                  int64_t max_packed_rows);

}  // namespace attnserve
