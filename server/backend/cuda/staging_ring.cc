#include "server/backend/cuda/staging_ring.h"

#include "absl/strings/str_cat.h"
#include "server/backend/cuda/cuda_util.h"
#include "server/core/status_macros.h"

namespace attnserve {

StagingRing::~StagingRing() {
  for (Slot& slot : slots_) {
    for (cudaEvent_t e : slot.events) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    cudaFree(slot.d_in);
    cudaFree(slot.d_out);
    cudaFreeHost(slot.h_in);
    cudaFreeHost(slot.h_out);
  }
}

absl::Status StagingRing::Init(int64_t in_capacity, int64_t out_capacity, int device) {
  in_capacity_ = in_capacity;
  out_capacity_ = out_capacity;
  for (Slot& slot : slots_) {
    ATTN_RETURN_IF_ERROR(DeviceAlloc(reinterpret_cast<void**>(&slot.d_in), in_capacity, "input staging", device));
    ATTN_RETURN_IF_ERROR(DeviceAlloc(reinterpret_cast<void**>(&slot.d_out), out_capacity, "output staging", device));
    ATTN_RETURN_IF_ERROR(PinnedAlloc(reinterpret_cast<void**>(&slot.h_in), in_capacity, "input staging"));
    ATTN_RETURN_IF_ERROR(PinnedAlloc(reinterpret_cast<void**>(&slot.h_out), out_capacity, "output staging"));
    for (cudaEvent_t& e : slot.events) ATTNSERVE_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
  }
  return absl::OkStatus();
}

absl::StatusOr<StagingRing::Slot*> StagingRing::NextFree() {
  absl::MutexLock lock(&mu_);
  if (in_flight_ >= kSlots) {
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA backend holds at most ", kSlots, " batches in flight"));
  }
  return &slots_[(head_ + in_flight_) % kSlots];
}

void StagingRing::Commit() {
  absl::MutexLock lock(&mu_);
  ++in_flight_;
}

absl::StatusOr<StagingRing::Slot*> StagingRing::Oldest() {
  absl::MutexLock lock(&mu_);
  if (in_flight_ == 0) return absl::FailedPreconditionError("no batch was submitted");
  return &slots_[head_];
}

void StagingRing::Release() {
  absl::MutexLock lock(&mu_);
  head_ = (head_ + 1) % kSlots;
  --in_flight_;
}

int StagingRing::InFlight() {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

}  // namespace attnserve
