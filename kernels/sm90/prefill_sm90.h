// The Hopper (sm_90a) paged prefill family: wgmma, a cp.async producer
// warpgroup feeding two consumer warpgroups through mbarriers. head_dim 64
// and 128; 128-row tiles (PrefillTileRows for PrefillKernel::kSm90,
// kSm90Overlap and kSm90OverlapNoPp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/kv_geometry.h"
#include "kernels/paged_prefill.h"
#include "kernels/plan/prefill_plan.h"

namespace attnserve {

// The consumer warpgroups' schedule (kernels/sm90/traits.cuh, Schedule):
// kSerial is PrefillKernel::kSm90; kOverlap (intra-warpgroup overlap and
// turns over both GEMMs) kSm90Overlap; kOverlapNoPingPong (the overlap
// alone) kSm90OverlapNoPp.
enum class Sm90Variant : int32_t { kSerial, kOverlap, kOverlapNoPingPong };

// Runs every work item (one CTA each) as PagedPrefillCuda documents.
// cudaErrorNotSupported on a device that is not compute capability 9.0 (the
// family is built only for sm_90a); cudaErrorInvalidValue for a head_dim
// other than 64 or 128.
cudaError_t PagedPrefillSm90(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse, Sm90Variant variant,
                             cudaStream_t stream);

// Resident CTAs per SM of the kernel on the current device (1 where it runs).
int32_t Sm90PrefillCtasPerSm(int32_t head_dim, KvDType dtype, Sm90Variant variant);

// Whether the current device runs this family (compute capability 9.x).
bool Sm90PrefillSupported();

}  // namespace attnserve
