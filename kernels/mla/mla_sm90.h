// The Hopper kernel of the MLA family (kernels/mla/mla_sm90.cu): the 64 x 64
// tile (64 packed rows, key blocks of 64 latent rows) by wgmma, for the
// large tile on sm_90 devices (H100, H200). Called through PagedMlaCuda
// (kernels/mla/mla_cuda.h), which owns the family's contract; this header is
// the family's own seam between its two kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/paged_prefill.h"
#include "kernels/plan/mla_plan.h"

namespace attnserve {

inline constexpr int32_t kMlaSm90TileRows = 64;
inline constexpr int32_t kMlaSm90KeyBlock = 64;

// Shared memory one CTA takes, in bytes.
int MlaSm90SmemBytes();

// Whether the current device runs the kernel: compute capability 9.0 (the
// kernel's body exists only in the sm_90a code) with the shared memory.
bool MlaSm90Runs();

// Runs every work item of a 64 x 64 plan (PagedMlaCuda's arguments);
// cudaErrorInvalidValue on a device that does not run it.
cudaError_t PagedMlaSm90(const PagedPrefillParams& params, const MlaWorkItem* items, int32_t num_items,
                         float* part_o, float* part_lse, cudaStream_t stream);

}  // namespace attnserve
