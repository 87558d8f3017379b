// The sm80 paged prefill family (mma.sync, sm_80+): host entry points.
// Callers go through kernels/prefill_cuda.h, which picks the family.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/kv_geometry.h"
#include "kernels/paged_prefill.h"
#include "kernels/plan/prefill_plan.h"

namespace attnserve {

// Runs every work item (one CTA each) with 128-row tiles, or 64-row tiles
// at head_dim 128 when rows64 (kernels/plan/kernel_select.h). Device
// pointers; head_dim 64, 128 or 256, else cudaErrorInvalidValue. 16-bit or
// FP8 pools (params.geo.kv_fp8; docs/design.md section 3, "FP8 KV cache").
cudaError_t PagedPrefillSm80(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse, bool rows64,
                             cudaStream_t stream);

// Resident CTAs per SM of that kernel on the current device (kv_fp8: the
// kernel for FP8 pools of that format).
int32_t Sm80PrefillCtasPerSm(int32_t head_dim, KvDType dtype, bool rows64, Fp8Format kv_fp8 = Fp8Format::kNone);

}  // namespace attnserve
