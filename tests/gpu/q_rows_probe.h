// The sm90 family's bf16-to-fp16 Q conversion run alone on the device
// (q_rows_probe.cu; sm_90a only).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace attnserve {
namespace gpu_test {

// Converts a 128-row tile of bf16 queries (device memory, rows of head_dim
// 64 or 128, dense) as the sm90 consumers do: out gets the fp16 rows,
// exps[128] each row's exponent. Synchronizes; cudaErrorInvalidValue for
// another head_dim.
cudaError_t RunQRowsProbe(int head_dim, const uint16_t* in, uint16_t* out, int8_t* exps, bool negative);

}  // namespace gpu_test
}  // namespace attnserve
