// Turns one batch of validated PrefillTasks into what the device runs: the
// batch-global sequences, routed to two kernel families (decode: sequences
// of 1..kMaxDecodeQueryRows rows, kernels/plan/decode_plan.h; prefill: the
// rest, with the kernel kernel_select picks; on an MLA geometry every
// sequence goes to the MLA family, kernels/plan/mla_plan.h), their plans, the appends with
// only the last write of each slot kept, and all of their bytes packed into
// a pinned staging buffer at offsets its device mirror shares (inline inputs
// that arrived in pieces, PrefillTask::*_scattered, gathered in that one
// copy). Host code
// only: no CUDA call, so the packer is the same on every GPU and is tested
// without one (tests/core/batch_packer_test.cc).
//
// The scheduler decides what a batch may hold (server/core/scheduler.cc);
// the backend's staging is sized from the same limits, so a batch that does
// not fit is an internal error, reported as such.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/kv_geometry.h"
#include "kernels/paged_prefill.h"
#include "kernels/plan/decode_plan.h"
#include "kernels/plan/kernel_select.h"
#include "kernels/plan/mla_plan.h"
#include "kernels/plan/prefill_plan.h"
#include "server/backend/backend.h"

namespace attnserve {

// What the staging was sized for, and the device the plan targets.
struct PackerLimits {
  int64_t max_rows = 0;           // query rows per batch
  int64_t max_indices = 0;        // KV page ids per batch
  int64_t max_append = 0;         // appended rows per batch
  int64_t max_items = 0;          // plan work items
  int64_t max_partial_pairs = 0;  // split-KV workspace, (row, head) pairs
  int32_t num_sms = 0;
  PrefillDevice device;
  PrefillFamily family = PrefillFamily::kAuto;  // --prefill_kernel
  int32_t ctas_per_sm[kNumPrefillKernels] = {1, 1, 1, 1, 1, 1};  // by PrefillKernel
  // Decode family: off sends every sequence to the prefill family
  // (--decode_kernel=off). Its split partials share the prefill family's
  // workspace (max_partial_pairs (row, head) pairs of head_dim floats; both
  // families run one after the other on one stream): at most
  // max_partial_pairs / DecodeMaxTileRows(head_dim) tile slots, and as many
  // split counters.
  bool decode = true;
  int32_t decode_ctas_per_sm[2] = {1, 1};  // by tile rows 16, 32
  int32_t decode_wide_ctas_per_sm[2] = {0, 0};  // by tile rows 16, 32 (0: no wide kernel)
  int32_t decode_max_cluster[2] = {0, 0};  // by tile rows 16, 32 (0: no cluster mode)
  int64_t max_decode_items = 0;
  // MLA geometries: the MLA family's tile shape and wave (its items and
  // merges take max_items and the merge section; its partial slots
  // MlaMaxPartialSlots(mla) * MlaMaxTileRows(mla) pairs of max_partial_pairs).
  MlaPlanOptions mla;
};

// Packed rows of the largest decode tile for head_dim (32, 16 for 256).
inline int32_t DecodeMaxTileRows(int32_t head_dim) { return DecodeTileRows(head_dim, 1 << 30); }
// Decode partial tile slots (and split counters) the limits allow.
inline int64_t DecodePartialSlots(const PackerLimits& limits, int32_t head_dim) {
  return limits.max_partial_pairs / DecodeMaxTileRows(head_dim);
}

// One packed batch: the kernel, the counts, and byte offsets into the input
// staging (and, for outputs, the output staging: o at 0, lse at off_lse).
struct PackedBatch {
  // Prefill family (num_items work items; none when every sequence decodes).
  // MLA geometries (mla): the MLA family's MlaWorkItems and MlaMergeTiles
  // (num_items, num_merges at off_items, off_merges) of mla_tile_rows rows.
  PrefillKernel kernel = PrefillKernel::kSm80;
  bool mla = false;
  int32_t mla_tile_rows = 0;
  int32_t mla_key_block = 0;
  int64_t total_q = 0;
  int32_t num_seqs = 0;
  int32_t num_items = 0;
  int32_t num_merges = 0;
  int32_t merge_pairs = 0;
  // Decode family: sequences it runs, its work items (at off_decode_items)
  // and tile rows; split tiles use the shared partials and the counters.
  int32_t num_decode_seqs = 0;
  int32_t num_decode_items = 0;
  int32_t decode_tile_rows = 16;
  int32_t decode_split_tiles = 0;
  int32_t decode_cluster = 0;  // > 1: the decode plan runs in cluster mode
  int64_t off_decode_items = 0;
  // Appended rows after dropping overwritten slots: the first num_append -
  // num_append_fp8 are geo.dtype rows (at off_k, off_v; quantized on the
  // way into an FP8 pool), the last num_append_fp8 FP8 rows as stored (at
  // off_k8, off_v8; PrefillTask::append_fp8). Their slots are one array at
  // off_slots in that order; distinct, so the two launches never race.
  int64_t num_append = 0;
  int64_t num_append_fp8 = 0;
  int64_t off_k8 = 0, off_v8 = 0;
  // The tasks' sink sets, one per task with sinks (PrefillTask::sinks), at
  // off_sinks (num_sink_sets * num_qo_heads floats); the sequences'
  // sink_index rebased to them. any_soft_cap: some sequence has a soft-cap
  // (PagedPrefillParams::any_soft_cap).
  int32_t num_sink_sets = 0;
  int64_t off_sinks = 0;
  bool any_soft_cap = false;
  // The prefill sequences' mean KV length per query row
  // (PagedPrefillParams::mean_kv_per_row; 0 when none).
  int64_t mean_kv_per_row = 0;
  int64_t off_q = 0, off_idx = 0, off_seqs = 0, off_items = 0, off_merges = 0;
  int64_t off_slots = 0, off_k = 0, off_v = 0;
  int64_t in_bytes = 0;  // staging bytes packed (holes for device inputs included)
  int64_t off_lse = 0;
  int64_t out_bytes = 0;
  // Inputs in device memory (CUDA regions, PrefillTask::*_on_device) and
  // large inputs in page-locked host memory (registered system regions,
  // *_pinned) are not packed: their bytes in the staging are holes that the
  // backend fills by a copy of `bytes` from `src` to d_in + `dst` after the
  // upload (device to device, or host to device straight from the region;
  // ranges of consecutive rows coalesced). The host filled staging
  // bytes [upload_begin, upload_end) only: the q holes at the front and the
  // appended K/V holes at the back are not uploaded.
  struct DeviceCopy {
    int64_t dst = 0;
    const void* src = nullptr;
    int64_t bytes = 0;
  };
  std::vector<DeviceCopy> device_in;
  int64_t upload_begin = 0, upload_end = 0;
};

class BatchPacker {
 public:
  BatchPacker(const KvGeometry& geo, const PackerLimits& limits) : geo_(geo), limits_(limits) {}

  // Staging bytes one batch at the limits needs, input and output.
  int64_t InputCapacity() const;
  int64_t OutputCapacity() const;

  // Packs `tasks` into staging (in_capacity bytes of pinned memory).
  absl::Status Pack(absl::Span<const PrefillTask> tasks, uint8_t* staging, int64_t in_capacity,
                    PackedBatch* out);

 private:
  // Batch-global sequences (q_start / kv_start shifted, layer set, q_len 0
  // dropped, sink_index to the batch's sink sets in sinks_) into seqs_, and
  // the batch's totals checked against the limits.
  absl::Status Flatten(absl::Span<const PrefillTask> tasks, PackedBatch* out, int64_t* total_idx);
  // Routes the sequences: the decode family's plan into decode_plan_, the
  // prefill kernel and its work items for the rest into plan_.
  absl::Status Plan(PackedBatch* out);
  absl::Status PlanDecode(const std::vector<PrefillSeq>& seqs, PackedBatch* out);
  absl::Status PlanMla(PackedBatch* out);
  // Appends in task order; a later write to the same (layer, slot) wins, so
  // only the last is kept (no races). The kept geo.dtype rows go first, the
  // FP8 rows last; returns how many are FP8.
  int64_t DedupAppends(absl::Span<const PrefillTask> tasks);

  KvGeometry geo_;
  PackerLimits limits_;
  // Scratch reused between batches (Pack runs on one thread).
  PrefillPlan plan_;
  DecodePlan decode_plan_;
  MlaPlan mla_plan_;
  std::vector<PrefillSeq> seqs_;
  std::vector<float> sinks_;  // the sink sets, (sets, num_qo_heads)
  std::vector<PrefillSeq> prefill_seqs_;  // seqs_ with decode sequences' q_len 0
  std::vector<std::pair<int32_t, int64_t>> append_rows_;  // (task, row); 16-bit rows first
  std::vector<int64_t> append_slots_;                     // layer-global
  absl::flat_hash_map<int64_t, int64_t> last_append_;
};

}  // namespace attnserve
