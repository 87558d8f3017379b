// Backend: the compute interface below the core (DESIGN.md section 2).
//
// The core validates every request, pins the pages it touches and hands the
// backend whole batches. A backend never sees a proto or a tenant; it gets
// plain pointers to host memory (request bytes and response buffers) and
// returns absl::Status. Implementations: CpuBackend (always built) and
// CudaBackend (built with ATTNSERVE_CUDA).
//
// Threading: the scheduler calls RunBatch / WriteKv / ReadKv from one worker
// thread at a time; Info() may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/common.h"
#include "kernels/merge_states.h"
#include "kernels/paged_prefill.h"

namespace attnserve {

// One validated Prefill request as the backend sees it. All pointers are host
// memory owned by the caller and valid until RunBatch returns.
struct PrefillTask {
  int32_t layer = 0;
  const void* q = nullptr;              // (total_q, num_qo_heads, head_dim)
  int32_t total_q = 0;
  // Sequences of this request; q_start is relative to q, kv_start relative to
  // kv_indices, layer equals `layer`.
  std::vector<PrefillSeq> seqs;
  const int32_t* kv_indices = nullptr;  // (num_kv_indices) page ids, validated
  int32_t num_kv_indices = 0;
  // Fused append, applied before any attention of the batch.
  const int64_t* append_slots = nullptr;  // (num_append) validated slots
  int64_t num_append = 0;
  const void* append_k = nullptr;         // (num_append, num_kv_heads, head_dim)
  const void* append_v = nullptr;         // (num_append, num_kv_heads, head_dim)
  // Outputs.
  void* o = nullptr;                      // (total_q, num_qo_heads, head_dim)
  float* lse = nullptr;                   // (total_q, num_qo_heads)
};

// What one batch cost, for metrics. Durations in seconds: device time on
// CUDA (events), wall time on the CPU backend.
struct BatchStats {
  int32_t attention_launches = 0;
  int32_t merge_launches = 0;
  int32_t append_launches = 0;
  double attention_seconds = 0;
  double merge_seconds = 0;
  double append_seconds = 0;
};

// Scatter (WriteKV) or gather (ReadKV) of rows by slot. Host pointers.
struct KvRows {
  int32_t layer = 0;
  const int64_t* slots = nullptr;  // (n) validated slots
  int64_t n = 0;
  void* k = nullptr;               // (n, num_kv_heads, head_dim)
  void* v = nullptr;               // (n, num_kv_heads, head_dim)
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string Name() const = 0;    // "cpu" or "cuda"
  virtual std::string Device() const = 0;  // human-readable device name
  virtual const KvGeometry& Geometry() const = 0;

  // Runs one batch: every task's fused append (in order), then attention
  // for every task. On error no output is valid.
  virtual absl::Status RunBatch(absl::Span<const PrefillTask> tasks,
                                BatchStats* stats) = 0;

  // Writes rows (k, v read) into the pools.
  virtual absl::Status WriteKv(const KvRows& rows, BatchStats* stats) = 0;
  // Reads rows (k, v written) out of the pools.
  virtual absl::Status ReadKv(const KvRows& rows) = 0;

  // N-way merge of states in host memory. Default: the CPU reference.
  virtual absl::Status MergeStates(const MergeStatesParams& params) {
    MergeStatesCpu(params);
    return absl::OkStatus();
  }
};

}  // namespace attnserve
