// KV append (scatter by slot, like vLLM's reshape_and_cache) and its inverse
// gather, on the GPU. Every pointer in the params is a device pointer; slots
// are validated by the caller (no bounds checks here).
//
// A batch of appends to several layers runs as one launch: pass layer = 0 and
// layer-global slots (layer * geo.SlotsPerLayer() + slot).
#pragma once

#include <cuda_runtime.h>

#include "kernels/append_kv.h"

namespace attnserve {

cudaError_t AppendKvCuda(const AppendKvParams& params, cudaStream_t stream);
cudaError_t GatherKvCuda(const GatherKvParams& params, cudaStream_t stream);
// One launch over every (layer, listed page); 16-byte stores.
cudaError_t ZeroPagesCuda(const ZeroPagesParams& params, cudaStream_t stream);

}  // namespace attnserve
