// The attention part of a packed batch on the compute stream: at most one
// launch per kernel family (decode, then prefill) and the prefill family's
// split merge, with the events the backend's metrics read.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/paged_prefill.h"
#include "server/backend/cuda/batch_packer.h"

namespace attnserve {

// Device workspace shared by both families (they run one after the other):
// fp32 partial states and the decode family's split counters (zero between
// launches: zeroed once at allocation, the kernel leaves them zero).
struct AttentionWorkspace {
  float* part_o = nullptr;
  float* part_lse = nullptr;
  int32_t* counters = nullptr;
};

// Queues the decode launch (b.num_decode_items), the prefill launch
// (b.num_items) and the merge (b.num_merges) on `stream`; for an MLA batch
// (b.mla) the MLA family's launch and its merge instead. params: q, o, lse,
// pools, kv_indices, seqs of the batch (device). d_in: the device staging
// holding the work items at b's offsets. Events (StagingRing::Event):
// kAttnBegin before the first attention launch, kDecodeEnd after the decode
// launch, kAttnEnd after the last, kMergeBegin / kMergeEnd around the merge.
absl::Status LaunchAttention(const PagedPrefillParams& params, const PackedBatch& b, const uint8_t* d_in,
                             const AttentionWorkspace& ws, cudaStream_t stream, cudaEvent_t* events);

}  // namespace attnserve
