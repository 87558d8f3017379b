// What AttentionCore's request paths share (attention_core_prefill.cc,
// attention_core_kv.cc): the region ranges a request holds (RegionUse) and
// Submit, which pins a request's pages and queues its Job. Included by
// those two files only.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/core/attention_core.h"
#include "server/core/status_macros.h"

namespace attnserve {

// The alignment a K or V row tensor in a region needs: its declared dtype's
// element (FP8: 1 byte), or 2 for a dtype no field takes (validation then
// names it).
inline int64_t RowElemBytes(const TensorView& t) {
  const int64_t bytes = TensorDTypeBytes(t.dtype);
  return bytes > 0 ? bytes : 2;
}

// The region ranges one request holds: inputs resolved into its tensors'
// views, outputs checked to be exactly their size and to overlap nothing
// else the request names nor an open channel's ring. Wrap() hands them to
// the done callback, which releases them after the edge has answered.
class AttentionCore::RegionUse {
 public:
  RegionUse(const RegionTable* table, const ChannelTable* channels, const std::string& tenant)
      : table_(table), channels_(channels), tenant_(tenant) {}

  // Points t->data at its region range when t names one.
  absl::Status Input(TensorView* t, int64_t elem_bytes, const std::string& field) {
    if (!t->region.set) return absl::OkStatus();
    if (t->byte_size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".data has ", t->byte_size(), " bytes and ", field,
          ".region is set: a tensor's bytes come from one of them"));
    }
    ATTN_ASSIGN_OR_RETURN(RegionSlice slice,
                          table_->Resolve(tenant_, t->region, elem_bytes, field + ".region"));
    t->data = absl::string_view(slice.data, static_cast<size_t>(slice.bytes));
    t->on_device = slice.on_device();
    t->pinned = !slice.on_device() && slice.registered();
    uses_.push_back({std::move(slice), field + ".region", false});
    return absl::OkStatus();
  }

  // Where an output goes: device memory (a CUDA region) or host memory,
  // and whether the device may copy into it directly (device memory, or a
  // page-locked system region).
  struct OutputSlot {
    char* data = nullptr;
    bool on_device = false;
    bool direct = false;
  };

  // The range an output of exactly `bytes` goes to.
  absl::StatusOr<OutputSlot> Output(const RegionRefView& ref, int64_t bytes, int64_t elem_bytes,
                                    const std::string& field) {
    ATTN_ASSIGN_OR_RETURN(RegionSlice slice, table_->Resolve(tenant_, ref, elem_bytes, field));
    if (slice.bytes != bytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".byte_size=", slice.bytes,
                                                     ", the output needs exactly ", bytes));
    }
    for (const Use& u : uses_) {
      if (!SlicesOverlap(u.slice, slice)) continue;
      const std::string where =
          u.slice.region == slice.region
              ? absl::StrCat(" in region '", ref.name, "'")
              : absl::StrCat(" of region '", u.slice.region->name, "', the same memory as region '",
                             ref.name, "'");
      return absl::InvalidArgumentError(absl::StrCat(field, " [", ref.offset, ", ", ref.offset + bytes,
                                                     ") overlaps ", u.field, where,
                                                     ": an output may not share bytes with another "
                                                     "tensor"));
    }
    // (Rings are in system regions.)
    if (!slice.on_device()) ATTN_RETURN_IF_ERROR(channels_->CheckNotRing(tenant_, slice, field, ref.name, ref.offset));
    OutputSlot out;
    out.data = slice.data;
    out.on_device = slice.on_device();
    out.direct = slice.on_device() || slice.registered();
    uses_.push_back({std::move(slice), field, true});
    return out;
  }

  bool empty() const { return uses_.empty(); }

  // `done`, then the ranges released; on success the bytes counted per path.
  DoneCallback Wrap(DoneCallback done, Metrics* metrics) {
    if (uses_.empty()) return done;
    int64_t in[2] = {0, 0}, out[2] = {0, 0};
    for (const Use& u : uses_) {
      const int k = u.slice.on_device() ? 1 : 0;
      (u.output ? out : in)[k] += u.slice.bytes;
    }
    return [done = std::move(done), uses = std::move(uses_), metrics, in0 = in[0], in1 = in[1],
            out0 = out[0], out1 = out[1]](absl::Status status) mutable {
      if (status.ok()) {
        metrics->AddTransferBytes(in0, out0, Metrics::Path::kSystem);
        metrics->AddTransferBytes(in1, out1, Metrics::Path::kCuda);
      }
      done(std::move(status));
      uses.clear();
    };
  }

 private:
  struct Use {
    RegionSlice slice;
    std::string field;
    bool output = false;
  };

  const RegionTable* const table_;
  const ChannelTable* const channels_;
  const std::string& tenant_;
  std::vector<Use> uses_;
};

template <typename CallT>
void AttentionCore::Submit(const CallT& call, std::vector<int32_t> pages,
                           const PageTable::PinNames& names, std::unique_ptr<Job> job) {
  job->tenant = call.tenant;
  job->request_id = call.request_id;
  job->response_bytes = job->held_bytes;  // what the caller set: the response buffers
  job->held_bytes += call.message_bytes;
  job->hold_response = call.hold_response;
  job->deadline = call.deadline;
  job->is_cancelled = call.is_cancelled;
  absl::Status status = RenewLease(call);
  if (status.ok()) {
    status = pages_.PinOwned(call.tenant, pages, names, PageTable::Holder::kRequest,
                             call.lease_id);
  }
  if (!status.ok()) {
    job->done(status);
    return;
  }
  job->pinned = std::move(pages);
  // Whether a Prefill's keys were written, asked only of the pages it owns.
  if (job->kind == Job::Kind::kPrefill && written_ != nullptr) {
    status = written_->CheckPrefill(job->task, job->plan ? &job->plan->unsettled : nullptr);
  }
  if (status.ok()) status = scheduler_->Enqueue(job);
  if (!status.ok()) {  // the job stayed with us
    // A page its owner freed meanwhile is released by this unpin.
    if (pages_.Unpin(job->pinned)) scheduler_->ScrubReleased(nullptr);
    job->done(status);
  }
}

}  // namespace attnserve
