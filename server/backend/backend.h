// Backend: the compute interface below the core (docs/design.md section 2).
//
// The core validates every request, pins the pages it touches and hands the
// backend whole batches. A backend never sees a proto or a tenant; it gets
// plain pointers to host memory (request bytes and response buffers) and
// returns absl::Status. Implementations: CpuBackend (always built) and
// CudaBackend (built with ATTNSERVE_CUDA).
//
// Batches are pipelined: Submit packs a batch and queues its work on the
// device without waiting; Complete waits for the oldest submitted batch and
// writes its outputs. Up to PipelineDepth() batches may be submitted and not
// yet completed, so the next batch's upload overlaps the current one's
// kernels and the previous one's download.
//
// Threading: one thread calls Submit, WriteKv, ReadKv and MergeStates; one
// other thread may call Complete at the same time. WriteKv, ReadKv and
// MergeStates are called only while no batch is submitted and not completed.
// Name, Device and Geometry may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/kv_geometry.h"
#include "kernels/merge_states.h"
#include "kernels/paged_prefill.h"
#include "server/backend/host_buffer.h"
#include "server/backend/region_device.h"
#include "common/scatter_list.h"

namespace attnserve {

// One validated Prefill request as the backend sees it. All pointers are
// owned by the caller and valid until the batch's Complete returns. They are
// host memory, except those whose *_on_device flag is set: device memory of a
// CUDA region, opened on the backend's device by its RegionDevice (only a
// backend whose RegionDevice opens IPC handles ever gets one). *_pinned: host
// memory that is page-locked (a system region registered with the device),
// which the device's copy engines may read directly. An inline input that
// arrived in several pieces (the slices gRPC received it in) is a
// ScatterList instead: its *_scattered list is not empty and its pointer is
// null. Inline host inputs are not aligned to anything.
struct PrefillTask {
  int32_t layer = 0;
  const void* q = nullptr;              // (total_q, num_qo_heads, head_dim)
  ScatterList q_scattered;              // or these pieces
  bool q_on_device = false;
  bool q_pinned = false;
  int32_t total_q = 0;
  // Sequences of this request; q_start is relative to q, kv_start relative to
  // kv_indices, layer equals `layer`. Their window_left and soft_cap are the
  // request's options; sink_index is 0 for those the sinks enter, -1 for the
  // rest (all of them when sinks is null).
  std::vector<PrefillSeq> seqs;
  // The request's index of each of seqs, where sequences without query rows
  // were left out (they read nothing; a Prefill of many such sequences would
  // otherwise hold about 50 bytes of memory for each 2 bytes of request).
  // Empty: seqs are the request's sequences, in order.
  std::vector<int32_t> seq_numbers;
  // (num_qo_heads) sink logits, natural units, or null: the one sink set of
  // this task (PagedPrefillParams::sinks[0 * num_qo_heads + head] as the
  // task's own seqs see it; a backend that packs several tasks rebases
  // sink_index). Host memory, in the request or its plan.
  const float* sinks = nullptr;
  const int32_t* kv_indices = nullptr;  // (num_kv_indices) page ids, validated
  int32_t num_kv_indices = 0;
  // Fused append, applied before any attention of the batch.
  const int64_t* append_slots = nullptr;  // (num_append) validated slots
  int64_t num_append = 0;
  const void* append_k = nullptr;         // (num_append, num_kv_heads, head_dim)
  const void* append_v = nullptr;         // (num_append, num_kv_heads, head_dim); MLA: null
  // FP8 pools: append_k / append_v hold FP8 bytes as the pools store them
  // (1 byte an element); false: geo.dtype values, quantized on the way in
  // (kernels/append_kv.h).
  bool append_fp8 = false;
  ScatterList append_k_scattered;         // or these pieces
  ScatterList append_v_scattered;
  bool append_k_on_device = false;
  bool append_v_on_device = false;
  bool append_k_pinned = false;
  bool append_v_pinned = false;
  // Outputs. Every byte of both is written when the batch completes, unless
  // given_up returned true.
  void* o = nullptr;                      // (total_q, num_qo_heads, VDim())
  float* lse = nullptr;                   // (total_q, num_qo_heads)
  bool o_on_device = false;
  bool lse_on_device = false;
  // Each of o and lse is device memory or pinned host memory (a buffer from
  // this backend's AllocateOutput, a page-locked system region): the device
  // may copy into them directly instead of through staging.
  bool out_pinned = false;
  // May be empty. True once the caller has given up on the request (a
  // cancelled gRPC call, which is never answered after that): a backend
  // that computes on the host may stop the task's attention there and leave
  // its outputs unwritten. Its fused append is done either way.
  std::function<bool()> given_up;
};

// What one batch cost, for metrics. Kernel durations in seconds: device time
// on CUDA (events), wall time on the CPU backend. Host durations are wall
// time on the calling thread.
struct BatchStats {
  // Attention launches of both kernel families (a batch mixing decode and
  // prefill sequences: 2); attention_seconds spans all of a batch's.
  int32_t attention_launches = 0;
  // The decode family's share of them (CUDA; kernels/decode/), and its time.
  int32_t attention_decode_launches = 0;
  int32_t merge_launches = 0;
  int32_t append_launches = 0;   // fused appends of a Prefill batch
  int32_t kv_rows_launches = 0;  // WriteKV scatters and ReadKV gathers
  int32_t zero_launches = 0;     // freed pages zeroed
  // Tasks whose attention stopped, or never began, because their caller had
  // given up (PrefillTask::given_up).
  int32_t given_up_tasks = 0;
  double attention_seconds = 0;
  double attention_decode_seconds = 0;
  double merge_seconds = 0;
  double append_seconds = 0;
  double kv_rows_seconds = 0;
  double zero_seconds = 0;
  double submit_seconds = 0;  // Submit: plan, pack and queue the batch
  double wait_seconds = 0;    // Complete: waiting for the device
  double unpack_seconds = 0;  // Complete: outputs to the tasks

  // Adds every count and duration of `o`.
  void Add(const BatchStats& o) {
    attention_launches += o.attention_launches;
    attention_decode_launches += o.attention_decode_launches;
    merge_launches += o.merge_launches;
    append_launches += o.append_launches;
    kv_rows_launches += o.kv_rows_launches;
    zero_launches += o.zero_launches;
    given_up_tasks += o.given_up_tasks;
    attention_seconds += o.attention_seconds;
    attention_decode_seconds += o.attention_decode_seconds;
    merge_seconds += o.merge_seconds;
    append_seconds += o.append_seconds;
    kv_rows_seconds += o.kv_rows_seconds;
    zero_seconds += o.zero_seconds;
    submit_seconds += o.submit_seconds;
    wait_seconds += o.wait_seconds;
    unpack_seconds += o.unpack_seconds;
  }
};

// Scatter (WriteKV) or gather (ReadKV) of rows by slot. Host pointers, but
// for k / v when *_on_device (a CUDA region, as in PrefillTask). A WriteKV's
// inline k / v may be pieces instead (*_scattered not empty, the pointer
// null), as PrefillTask's inputs.
//
// On an FP8 pool, rows_fp8 says what k and v hold: FP8 bytes as the pools
// store them (a WriteKV of FP8 rows, a ReadKV of the stored bytes), or
// geo.dtype values (a WriteKV quantized on the way in, a ReadKV dequantized
// on the way out; kernels/append_kv.h). Always false on a 16-bit pool.
struct KvRows {
  int32_t layer = 0;
  const int64_t* slots = nullptr;  // (n) validated slots, host
  int64_t n = 0;
  void* k = nullptr;               // (n, num_kv_heads, head_dim)
  void* v = nullptr;               // (n, num_kv_heads, head_dim); MLA: null
  bool rows_fp8 = false;
  ScatterList k_scattered;         // WriteKV: or these pieces
  ScatterList v_scattered;
  bool k_on_device = false;
  bool v_on_device = false;
};

// Which tensors of a MergeStates lie in device memory (CUDA regions, as in
// PrefillTask); empty or all false: every one is host memory.
struct MergeOnDevice {
  std::vector<bool> v, lse;  // (num_states) or empty
  bool v_out = false;
  bool lse_out = false;
  bool any() const {
    for (bool b : v) if (b) return true;
    for (bool b : lse) if (b) return true;
    return v_out || lse_out;
  }
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string Name() const = 0;    // "cpu" or "cuda"
  virtual std::string Device() const = 0;  // human-readable device name
  virtual const KvGeometry& Geometry() const = 0;
  // Non-zero when the backend computes every sequence of at least this many
  // query rows with its queries rounded to E4M3 (the CUDA backend under
  // --prefill_kernel=sm90_fp8q: 1, or kMaxDecodeQueryRows + 1 where the
  // decode family takes the shorter ones); ServerInfo.fp8_query_min_rows.
  virtual int32_t Fp8QueryMinRows() const { return 0; }

  // Memory in use on the backend's device (the KV pools, staging, workspace,
  // the CUDA context and anything else there), and the device's total, in
  // bytes; read at construction. Zeros: no device (the CPU backend).
  struct MemoryUsage {
    int64_t used_bytes = 0;
    int64_t total_bytes = 0;
  };
  virtual MemoryUsage Memory() const { return {}; }

  // Host memory for one request's outputs (o then lse, as the core lays them
  // out). Called from any thread. Default: the heap. An empty buffer means
  // the memory is not there.
  virtual HostBuffer AllocateOutput(int64_t bytes) { return HeapBuffer(bytes); }

  // Hooks for shared-memory regions (page-locking host regions, CUDA IPC);
  // null: the defaults of RegionDevice. Lives as long as the backend.
  virtual RegionDevice* region_device() { return nullptr; }

  // Batches that may be submitted and not yet completed (at least 1).
  virtual int PipelineDepth() const { return 1; }

  // Queues one batch: every task's fused append (in order), then attention
  // for every task. The tasks' pointers must stay valid until the matching
  // Complete returns. On error nothing was queued and the batch needs no
  // Complete. stats receives submit_seconds.
  virtual absl::Status Submit(absl::Span<const PrefillTask> tasks, BatchStats* stats) = 0;

  // Waits for the oldest submitted batch and writes its outputs (o, lse of
  // each task). On error none of that batch's outputs is valid.
  virtual absl::Status Complete(BatchStats* stats) = 0;

  // Writes rows (k, v read) into the pools.
  virtual absl::Status WriteKv(const KvRows& rows, BatchStats* stats) = 0;
  // Reads rows (k, v written) out of the pools.
  virtual absl::Status ReadKv(const KvRows& rows, BatchStats* stats) = 0;

  // Sets every KV row of `pages` to zero in every layer (freed pages, before
  // anyone may allocate them again). Same threading as WriteKv.
  virtual absl::Status ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) = 0;

  // FP8 pools: the scales of `layer` (num_kv_heads entries each, validated:
  // finite and positive) that later writes quantize with and later reads
  // and attention dequantize with (kernels/fp8.h). Every layer starts at
  // 1.0. Same threading as WriteKv. FAILED_PRECONDITION on a 16-bit pool.
  virtual absl::Status SetKvScales(int32_t layer, absl::Span<const float> k_scales,
                                   absl::Span<const float> v_scales) = 0;

  // N-way merge of states. Default: the CPU reference, host memory only
  // (FAILED_PRECONDITION for a tensor on a device).
  virtual absl::Status MergeStates(const MergeStatesParams& params, const MergeOnDevice& on_device) {
    if (on_device.any()) {
      return absl::FailedPreconditionError(
          absl::StrCat("MergeStates: the ", Name(), " backend cannot read or write device memory"));
    }
    MergeStatesCpu(params);
    return absl::OkStatus();
  }
};

}  // namespace attnserve
