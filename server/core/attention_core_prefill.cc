// AttentionCore::Prefill (and Cancel): the request's region tensors, its
// plan or layout, validation, its pages pinned and its Job queued
// (attention_core_requests.h).
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/attention_core.h"
#include "server/core/attention_core_requests.h"
#include "server/core/status_macros.h"

namespace attnserve {
namespace {

// How a Prefill's pin errors name its pages: kv_indices, then the append
// slots' pages.
PageTable::PinNames PrefillPinNames(const PrefillTask& task) {
  return {"kv_indices", static_cast<size_t>(task.num_kv_indices), "append_slots", task.append_slots};
}

}  // namespace

void AttentionCore::Prefill(const PrefillCall& request, DoneCallback done) {
  // Tensors in regions: resolved into a copy of the call whose views point
  // into the mappings (no copy of the bytes).
  RegionUse regions(&regions_, &channels_, request.tenant);
  PrefillCall resolved;
  const bool any_region = request.q.region.set || request.append_k.region.set ||
                          request.append_v.region.set || request.out_region.set ||
                          request.lse_region.set;
  if (any_region) {
    resolved = request;
    const int64_t elem = backend_->Geometry().QElemBytes();
    absl::Status status = regions.Input(&resolved.q, elem, "q");
    // The alignment of K and V rows is their declared dtype's (FP8: 1 byte).
    if (status.ok()) {
      status = regions.Input(&resolved.append_k, RowElemBytes(resolved.append_k), "append_k");
    }
    if (status.ok()) {
      status = regions.Input(&resolved.append_v, RowElemBytes(resolved.append_v), "append_v");
    }
    if (status.ok() && resolved.out_region.set != resolved.lse_region.set) {
      status = absl::InvalidArgumentError(
          "output_region and lse_region go together: set both or neither");
    }
    if (!status.ok()) {
      done(status);
      return;
    }
  }
  const PrefillCall& call = any_region ? resolved : request;
  std::shared_ptr<const Plan> plan;
  absl::StatusOr<ValidatedPrefill> validated;
  if (call.plan_id != 0) {
    if (absl::Status stale = CheckIncarnation(call.expected_incarnation, incarnation_);
        !stale.ok()) {
      done(stale);
      return;
    }
    // A lease that is gone says so, rather than that its plan is unknown.
    if (absl::Status lease = RenewLease(call); !lease.ok()) {
      done(lease);
      return;
    }
    auto found = plans_.Find(call.tenant, call.plan_id);
    if (!found.ok()) {
      done(found.status());
      return;
    }
    plan = *std::move(found);
    if (absl::Status held = CheckPlanLease(*plan, call.lease_id); !held.ok()) {
      done(held);
      return;
    }
    validated = ValidatePlannedPrefill(call, plan->layout, plan->kv_indices.data(),
                                       plan->append_slots.data(), plan->options,
                                       backend_->Geometry(), limits_, incarnation_);
  } else {
    validated = ValidatePrefill(call, backend_->Geometry(), limits_, incarnation_);
  }
  // The fused append's rows, marked once written (they are checked in
  // Submit, once the pages are known to be the caller's).
  std::function<void()> mark;
  if (validated.ok() && written_ != nullptr) {
    mark = written_->Marker(validated->task.layer, validated->task.append_slots,
                            validated->task.num_append, plan);
  }
  if (!validated.ok()) {
    done(validated.status());
    return;
  }
  // One buffer for both outputs, from the backend (pinned where that lets the
  // device copy into it); never zero-filled, the backend writes every byte.
  PrefillOutput* out = call.out;
  const KvGeometry& g = backend_->Geometry();
  out->dtype = g.dtype;
  out->total_q = validated->task.total_q;
  out->max_seq_q_rows = 0;
  for (const PrefillSeq& s : validated->task.seqs) {
    out->max_seq_q_rows = std::max<int64_t>(out->max_seq_q_rows, s.q_len);
  }
  out->num_qo_heads = g.num_qo_heads;
  out->v_head_dim = g.VDim();
  if (call.out_region.set) {
    const int64_t elem = g.QElemBytes();
    auto o = regions.Output(call.out_region, validated->out_bytes, elem, "output_region");
    if (!o.ok()) {
      done(o.status());
      return;
    }
    auto lse = regions.Output(call.lse_region, validated->lse_bytes, 4, "lse_region");
    if (!lse.ok()) {
      done(lse.status());
      return;
    }
    out->in_region = true;
    auto job = std::make_unique<Job>();
    job->kind = Job::Kind::kPrefill;
    job->task = std::move(validated->task);
    job->plan = std::move(plan);
    job->task.o = o->data;
    job->task.lse = reinterpret_cast<float*>(lse->data);
    job->task.o_on_device = o->on_device;
    job->task.lse_on_device = lse->on_device;
    job->task.out_pinned = o->direct && lse->direct;
    job->on_success = std::move(mark);
    job->done = regions.Wrap(std::move(done), metrics_);
    const PageTable::PinNames names = PrefillPinNames(job->task);
    Submit(call, std::move(validated->pages), names, std::move(job));
    return;
  }
  out->o_bytes = validated->out_bytes;
  out->lse_offset = (validated->out_bytes + 63) / 64 * 64;
  out->lse_bytes = validated->lse_bytes;
  const int64_t out_bytes = out->lse_offset + out->lse_bytes;
  if (out_bytes > 0) {
    out->buffer = backend_->AllocateOutput(out_bytes);
    if (out->buffer.data() == nullptr) {
      done(absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", out_bytes, " bytes of host memory for the response")));
      return;
    }
  }
  auto job = std::make_unique<Job>();
  job->kind = Job::Kind::kPrefill;
  job->task = std::move(validated->task);
  job->plan = std::move(plan);
  if (out_bytes > 0) {
    job->task.o = out->buffer.data();
    job->task.lse = reinterpret_cast<float*>(out->buffer.data() + out->lse_offset);
    job->task.out_pinned = out->buffer.pinned();
  }
  job->held_bytes = out_bytes;
  job->on_success = std::move(mark);
  job->done = regions.Wrap(std::move(done), metrics_);
  const PageTable::PinNames names = PrefillPinNames(job->task);
  Submit(call, std::move(validated->pages), names, std::move(job));
}

void AttentionCore::Cancel(const std::string& tenant, uint64_t request_id, absl::Status why) {
  scheduler_->CancelQueued(tenant, request_id, std::move(why));
}

}  // namespace attnserve
