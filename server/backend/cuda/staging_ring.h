// The CUDA backend's pipeline of staging slots. Each slot is a pinned input
// buffer and its device mirror, a device output buffer and its pinned mirror,
// and the events that order and time one batch. A batch in slot s is
// uploaded on the copy-in stream, computed on the compute stream (after the
// upload's event) and downloaded on the copy-out stream (after the compute's
// event), so batch N+1's upload and batch N-1's download overlap batch N's
// kernels.
//
// Threading: one thread fills slots (NextFree, Commit); one other thread
// drains them (Oldest, Release). The ring's bookkeeping is locked; a slot's
// contents belong to whoever holds it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

class StagingRing {
 public:
  static constexpr int kSlots = 2;
  // Events of one batch: kernel spans, then the three stream hand-offs.
  enum Event {
    kAppendBegin,
    kAppendEnd,
    kAttnBegin,
    kAttnEnd,
    kDecodeEnd,  // between the decode and prefill launches of a batch
    kMergeBegin,
    kMergeEnd,
    kUploaded,
    kComputed,
    kDownloaded,
    kNumEvents
  };

  struct Slot {
    uint8_t* h_in = nullptr;   // pinned inputs, packed
    uint8_t* d_in = nullptr;   // their device mirror (same layout)
    uint8_t* d_out = nullptr;  // outputs: o, then lse at off_lse
    uint8_t* h_out = nullptr;  // pinned mirror of d_out
    cudaEvent_t events[kNumEvents] = {};
    // The batch in flight: where Complete puts each task's rows.
    struct Output {
      void* o;
      float* lse;
      int64_t rows;
      // Copied into o / lse directly by the device (pinned host memory or
      // device memory), nothing to unpack.
      bool o_direct;
      bool lse_direct;
    };
    std::vector<Output> outputs;
    int64_t off_lse = 0;
    bool appended = false, merged = false;
    int32_t attention_launches = 0;  // decode and / or prefill family
    bool decoded = false;            // the decode family ran (kAttnBegin..kDecodeEnd)
  };

  StagingRing() = default;
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;
  // Frees the buffers and events; the caller has synchronized the streams.
  ~StagingRing();

  // Allocates every slot on the current device.
  absl::Status Init(int64_t in_capacity, int64_t out_capacity, int device);

  int64_t in_capacity() const { return in_capacity_; }
  int64_t out_capacity() const { return out_capacity_; }

  // The slot the next batch fills; FailedPrecondition when every slot holds
  // a batch in flight. Its previous batch was released, so it may be
  // overwritten.
  absl::StatusOr<Slot*> NextFree();
  // The slot NextFree returned now holds a batch in flight.
  void Commit();
  // The oldest batch in flight; FailedPrecondition when none.
  absl::StatusOr<Slot*> Oldest();
  // The oldest batch leaves the ring (whether it succeeded or not, so the
  // pipeline never wedges on a failed batch).
  void Release();
  int InFlight();
  // Slot 0, for synchronous KV copies while nothing is in flight.
  Slot& IdleSlot() { return slots_[0]; }

 private:
  Slot slots_[kSlots];
  int64_t in_capacity_ = 0;
  int64_t out_capacity_ = 0;
  absl::Mutex mu_;
  // Batches in flight occupy slots head_, head_ + 1, ... (mod kSlots).
  int head_ ABSL_GUARDED_BY(mu_) = 0;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve
