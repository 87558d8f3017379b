#include "server/backend/cuda/attention_launch.h"

#include "kernels/decode/decode_cuda.h"
#include "kernels/merge/merge_cuda.h"
#include "kernels/mla/mla_cuda.h"
#include "kernels/prefill_cuda.h"
#include "server/backend/cuda/cuda_util.h"
#include "server/backend/cuda/staging_ring.h"

namespace attnserve {

absl::Status LaunchAttention(const PagedPrefillParams& pp, const PackedBatch& b, const uint8_t* d_in,
                             const AttentionWorkspace& ws, cudaStream_t stream, cudaEvent_t* ev) {
  using Ev = StagingRing::Event;
  if (b.num_decode_items == 0 && b.num_items == 0) return absl::OkStatus();
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kAttnBegin], stream));
  if (b.mla) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(PagedMlaCuda(pp, b.mla_tile_rows, b.mla_key_block,
                                                reinterpret_cast<const MlaWorkItem*>(d_in + b.off_items),
                                                b.num_items, ws.part_o, ws.part_lse, stream));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kAttnEnd], stream));
    if (b.num_merges > 0) {
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kMergeBegin], stream));
      ATTNSERVE_CUDA_RETURN_IF_ERROR(MergeMlaCuda(pp, b.mla_tile_rows,
                                                  reinterpret_cast<const MlaMergeTile*>(d_in + b.off_merges),
                                                  b.num_merges, ws.part_o, ws.part_lse, stream));
      ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kMergeEnd], stream));
    }
    return absl::OkStatus();
  }
  if (b.num_decode_items > 0) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(PagedDecodeCuda(pp, b.decode_tile_rows,
                                                   reinterpret_cast<const DecodeWorkItem*>(d_in + b.off_decode_items),
                                                   b.num_decode_items, ws.part_o, ws.part_lse, ws.counters, stream,
                                                   DecodeLaunchOptions{b.decode_cluster, false}));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kDecodeEnd], stream));
  }
  if (b.num_items > 0) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(PagedPrefillCuda(pp, reinterpret_cast<const PrefillWorkItem*>(d_in + b.off_items),
                                                    b.num_items, ws.part_o, ws.part_lse, b.kernel, stream));
  }
  ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kAttnEnd], stream));
  if (b.num_merges > 0) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kMergeBegin], stream));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(MergeSplitsCuda(pp, reinterpret_cast<const SplitMergeSeq*>(d_in + b.off_merges),
                                                   b.num_merges, b.merge_pairs, ws.part_o, ws.part_lse, stream));
    ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[Ev::kMergeEnd], stream));
  }
  return absl::OkStatus();
}

}  // namespace attnserve
