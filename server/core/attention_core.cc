#include "server/core/attention_core.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/backend/factory.h"
#include "server/core/status_macros.h"

namespace attnserve {
namespace {

uint64_t MakeIncarnation() {
  absl::BitGen gen;
  uint64_t id = 0;
  while (id == 0) id = absl::Uniform<uint64_t>(gen);  // 0 means "not checked"
  return id;
}

// How a Prefill's pin errors name its pages: kv_indices, then the append
// slots' pages.
PageTable::PinNames PrefillPinNames(const PrefillTask& task) {
  return {"kv_indices", static_cast<size_t>(task.num_kv_indices), "append_slots", task.append_slots};
}

}  // namespace

// The region ranges one request holds: inputs resolved into its tensors'
// views, outputs checked to be exactly their size and to overlap nothing
// else the request names. Wrap() hands them to the done callback, which
// releases them after the edge has answered.
class AttentionCore::RegionUse {
 public:
  RegionUse(const RegionTable* table, const std::string& tenant)
      : table_(table), tenant_(tenant) {}

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
  const std::string& tenant_;
  std::vector<Use> uses_;
};

namespace {

// The alignment a K or V row tensor in a region needs: its declared dtype's
// element (FP8: 1 byte), or 2 for a dtype no field takes (validation then
// names it).
int64_t RowElemBytes(const TensorView& t) {
  const int64_t bytes = TensorDTypeBytes(t.dtype);
  return bytes > 0 ? bytes : 2;
}

// A request naming a lease may use only a plan made under it.
absl::Status CheckPlanLease(const Plan& plan, uint64_t lease) {
  if (lease == 0 || plan.lease == lease) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "plan_id=%d is not held under lease %#x: a client may use only the plans of its own lease",
      plan.id, lease));
}

}  // namespace

int32_t MaxRequestRows(const CoreOptions& options, const KvGeometry& geo) {
  const int64_t q_row_bytes = geo.QRowElems() * geo.QElemBytes();
  const int64_t rows = options.max_message_bytes / std::max<int64_t>(q_row_bytes, 1);
  return static_cast<int32_t>(
      std::clamp<int64_t>(std::max<int64_t>(rows, options.max_batch_tokens), 1, 1 << 30));
}

AttentionCore::AttentionCore(CoreOptions options, std::unique_ptr<Backend> backend,
                             Metrics* metrics)
    : options_(options),
      backend_(std::move(backend)),
      metrics_(metrics),
      incarnation_(MakeIncarnation()),
      pages_(backend_->Geometry().num_pages, options.tenant_max_pages, options.scrub_freed_pages),
      plans_(options.max_plans_per_tenant, options.max_plan_bytes_per_tenant,
             absl::Seconds(options.plan_idle_timeout_s)),
      regions_(options.regions, backend_->region_device()),
      channels_(options.channels),
      leases_(options.leases) {
  regions_.SetReleaseListener([this](const Region* region) {
    for (const std::string& tenant : channels_.CloseRegion(region)) UpdateChannelGauge(tenant);
  });
  if (options.check_kv_written) written_ = std::make_unique<WrittenRows>(backend_->Geometry());
  {
    const KvGeometry& g = backend_->Geometry();
    absl::MutexLock lock(&scales_mu_);
    if (g.KvIsFp8()) {
      k_scales_.assign(static_cast<size_t>(g.num_layers) * g.num_kv_heads, 1.f);
      v_scales_ = k_scales_;
    }
  }
  limits_.max_message_bytes = options.max_message_bytes;
  limits_.max_request_rows = MaxRequestRows(options, backend_->Geometry());
  limits_.max_request_kv_indices = options.max_request_kv_indices;
  SchedulerOptions sched;
  sched.max_batch_tokens = options.max_batch_tokens;
  sched.max_batch_kv_indices = options.max_request_kv_indices;
  sched.max_batch_append_rows = limits_.max_request_rows;
  sched.max_queue_delay_us = options.max_queue_delay_us;
  sched.idle_spin_us = options.idle_spin_us;
  sched.max_queue_requests = options.max_queue_requests;
  sched.max_tenant_queue_requests = options.max_tenant_queue_requests;
  sched.max_queue_bytes = options.max_queue_bytes;
  sched.max_tenant_queue_bytes = options.max_tenant_queue_bytes;
  scheduler_ = std::make_unique<Scheduler>(backend_.get(), &pages_, metrics_, sched);
  UpdatePageGauges();
  metrics_->SetKvCacheBytes(BytesPerPage(backend_->Geometry()) * backend_->Geometry().num_pages);
  const Backend::MemoryUsage memory = backend_->Memory();
  if (memory.total_bytes > 0) metrics_->SetDeviceMemory(memory.used_bytes, memory.total_bytes);
  reaper_ = std::thread([this] { ReapLoop(); });
}

AttentionCore::~AttentionCore() { Shutdown(); }

void AttentionCore::Shutdown() {
  if (!stop_reaper_.HasBeenNotified()) stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  CloseAllChannels();
  scheduler_->Stop();
}

void AttentionCore::ReapLoop() {
  while (!stop_reaper_.WaitForNotificationWithTimeout(options_.reap_interval)) {
    const absl::Time now = absl::Now();
    std::vector<LeaseTable::Ended> ended = leases_.TakeExpired(now);
    if (!ended.empty()) {
      for (const LeaseTable::Ended& e : ended) {
        HoldingsData released;
        {
          absl::MutexLock lock(&lease_mu_);
          released = ReleaseHeld(e.tenant, e.id);
        }
        metrics_->SetTenantLeases(e.tenant, leases_.TenantLeases(e.tenant));
        CountRelease(Metrics::Release::kExpired, 1, released);
      }
    }
    plans_.TakeExpired(now);
  }
}
void AttentionCore::SampleGauges() const { metrics_->SetQueueHeldBytes(scheduler_->held_bytes()); }

ServerInfoData AttentionCore::Info() const {
  const KvGeometry& g = backend_->Geometry();
  ServerInfoData info;
  info.version = kVersion;
  info.backend = backend_->Name();
  info.device = backend_->Device();
  info.num_layers = g.num_layers;
  info.num_pages = g.num_pages;
  info.page_size = g.page_size;
  info.num_qo_heads = g.num_qo_heads;
  info.num_kv_heads = g.num_kv_heads;
  info.head_dim = g.head_dim;
  info.attention = g.attention;
  info.v_head_dim = g.VDim();
  info.kv_lora_rank = g.kv_lora_rank;
  info.qk_rope_head_dim = g.qk_rope_head_dim;
  info.kv_dtype = g.dtype;
  info.kv_fp8 = g.kv_fp8;
  info.page_bytes = BytesPerPage(g);
  info.kv_cache_bytes = info.page_bytes * g.num_pages;
  info.free_pages = pages_.FreeCount();
  info.max_batch_tokens = options_.max_batch_tokens;
  info.max_message_bytes = options_.max_message_bytes;
  info.incarnation = incarnation_;
  info.lease_default_ttl_ms = absl::ToInt64Milliseconds(leases_.limits().default_ttl);
  info.lease_max_ttl_ms = absl::ToInt64Milliseconds(leases_.limits().max_ttl);
  return info;
}

void AttentionCore::UpdatePageGauges() {
  const int32_t free_pages = pages_.FreeCount();
  metrics_->SetKvPages(free_pages, pages_.num_pages() - free_pages);
}

absl::StatusOr<std::vector<int32_t>> AttentionCore::AllocatePages(const CallContext& ctx,
                                                                  int32_t count) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(ctx.expected_incarnation, incarnation_));
  if (count <= 0 || count > pages_.num_pages()) {
    return absl::InvalidArgumentError(
        absl::StrCat("count=", count, " out of range [1, ", pages_.num_pages(), "] (num_pages)"));
  }
  absl::ReaderMutexLock hold(&lease_mu_);
  ATTN_RETURN_IF_ERROR(RenewLease(ctx));
  auto pages = pages_.Allocate(ctx.tenant, count, ctx.lease_id);
  if (pages.ok() && written_ != nullptr) written_->Reset(*pages);
  UpdatePageGauges();
  if (pages.ok()) metrics_->SetTenantPages(ctx.tenant, pages_.TenantPages(ctx.tenant));
  return pages;
}

void AttentionCore::FreePages(const CallContext& ctx, absl::Span<const int32_t> page_ids,
                              DoneCallback done) {
  if (absl::Status stale = CheckIncarnation(ctx.expected_incarnation, incarnation_); !stale.ok()) {
    done(stale);
    return;
  }
  absl::Status status = RenewLease(ctx);
  if (status.ok()) status = pages_.Free(ctx.tenant, page_ids, ctx.lease_id);
  UpdatePageGauges();
  if (status.ok()) metrics_->SetTenantPages(ctx.tenant, pages_.TenantPages(ctx.tenant));
  if (!status.ok()) {
    done(status);
    return;
  }
  // A freed page still holds its owner's KV: it is zeroed before anyone can
  // allocate it again.
  // The scheduler updates the page gauges as each part is zeroed.
  scheduler_->ScrubReleased(std::move(done));
}

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

absl::StatusOr<uint64_t> AttentionCore::CreatePlan(const CallContext& ctx,
                                                    const PrefillLayout& layout,
                                                    const PlanOptionsView& options) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(ctx.expected_incarnation, incarnation_));
  auto plan = std::make_unique<Plan>();
  plan->tenant = ctx.tenant;
  plan->lease = ctx.lease_id;
  plan->kv_indices.assign(layout.kv_indices.begin(), layout.kv_indices.end());
  plan->append_slots.assign(layout.append_slots.begin(), layout.append_slots.end());
  const PrefillLayout owned{layout.qo_indptr,        layout.kv_indptr,   plan->kv_indices,
                            layout.kv_last_page_len, plan->append_slots, layout.kv_keys_after,
                            layout.apply_sinks};
  ATTN_ASSIGN_OR_RETURN(plan->layout, ValidatePlanLayout(owned, backend_->Geometry(), limits_));
  ATTN_ASSIGN_OR_RETURN(plan->options, ValidatePlanOptions(options, backend_->Geometry()));
  absl::ReaderMutexLock hold(&lease_mu_);
  ATTN_RETURN_IF_ERROR(RenewLease(ctx));
  ATTN_RETURN_IF_ERROR(pages_.PinOwned(
      ctx.tenant, plan->layout.pages,
      {"kv_indices", plan->kv_indices.size(), "append_slots", plan->append_slots.data()},
      PageTable::Holder::kPlan, ctx.lease_id));
  // Once pinned, a page whole in every layer stays so: its requests' checks
  // skip it.
  if (written_ != nullptr) {
    plan->unsettled = written_->Unsettled(plan->layout.seqs, plan->kv_indices.data());
  }
  // The pins go with the last reference: the table's, or a request's that
  // still uses the plan after it was released.
  std::shared_ptr<Plan> shared(plan.release(), [this](Plan* p) {
    if (pages_.Unpin(p->layout.pages, PageTable::Holder::kPlan)) {
      scheduler_->ScrubReleased(nullptr);
    }
    UpdatePageGauges();
    delete p;
  });
  return plans_.Add(std::move(shared));
}

absl::Status AttentionCore::ReleasePlan(const CallContext& ctx, uint64_t plan_id) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(ctx.expected_incarnation, incarnation_));
  if (ctx.lease_id != 0) {
    ATTN_RETURN_IF_ERROR(RenewLease(ctx));
    ATTN_ASSIGN_OR_RETURN(std::shared_ptr<const Plan> plan, plans_.Find(ctx.tenant, plan_id));
    ATTN_RETURN_IF_ERROR(CheckPlanLease(*plan, ctx.lease_id));
  }
  return plans_.Remove(ctx.tenant, plan_id);
}

void AttentionCore::UpdateRegionGauges(const std::string& tenant) {
  const RegionTable::Usage used = regions_.TenantUsage(tenant);
  metrics_->SetTenantRegions(tenant, used.count, used.bytes);
}

absl::Status AttentionCore::RegisterRegion(const CallContext& ctx, const RegionSpec& spec) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(ctx.expected_incarnation, incarnation_));
  RegionSpec leased = spec;
  leased.lease = ctx.lease_id;
  absl::ReaderMutexLock hold(&lease_mu_);
  ATTN_RETURN_IF_ERROR(RenewLease(ctx));
  absl::Status status = regions_.Register(ctx.tenant, leased);
  UpdateRegionGauges(ctx.tenant);
  return status;
}

absl::Status AttentionCore::UnregisterRegion(const CallContext& ctx, absl::string_view name) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(ctx.expected_incarnation, incarnation_));
  absl::Status status = regions_.Unregister(ctx.tenant, name);
  UpdateRegionGauges(ctx.tenant);
  return status;
}

std::vector<RegionInfoData> AttentionCore::ListRegions(const CallContext& ctx) {
  std::vector<RegionInfoData> out = regions_.List(ctx.tenant);
  UpdateRegionGauges(ctx.tenant);
  UpdateChannelGauge(ctx.tenant);  // the channels in those regions
  return out;
}

void AttentionCore::UpdateChannelGauge(const std::string& tenant) {
  metrics_->SetOpenChannels(tenant, channels_.TenantChannels(tenant));
}

absl::StatusOr<uint64_t> AttentionCore::OpenChannel(const CallContext& ctx,
                                                    const RegionRefView& ring,
                                                    const ChannelTable::MakeEndpoint& make) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(ctx.expected_incarnation, incarnation_));
  absl::ReaderMutexLock hold(&lease_mu_);
  ATTN_RETURN_IF_ERROR(RenewLease(ctx));
  auto id = channels_.Open(ctx.tenant, regions_, ring, make, ctx.lease_id);
  UpdateChannelGauge(ctx.tenant);
  return id;
}

absl::Status AttentionCore::CloseChannel(const CallContext& ctx, uint64_t channel_id) {
  absl::Status status = channels_.Close(ctx.tenant, channel_id);
  UpdateChannelGauge(ctx.tenant);
  return status;
}

void AttentionCore::CloseAllChannels() {
  for (const std::string& tenant : channels_.CloseAll()) UpdateChannelGauge(tenant);
}

void AttentionCore::Prefill(const PrefillCall& request, DoneCallback done) {
  // Tensors in regions: resolved into a copy of the call whose views point
  // into the mappings (no copy of the bytes).
  RegionUse regions(&regions_, request.tenant);
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

void AttentionCore::WriteKv(const WriteKvCall& request, DoneCallback done) {
  if (absl::Status stale = CheckIncarnation(request.expected_incarnation, incarnation_);
      !stale.ok()) {
    done(stale);
    return;
  }
  RegionUse regions(&regions_, request.tenant);
  WriteKvCall resolved;
  const bool any_region = request.k.region.set || request.v.region.set;
  if (any_region) {
    resolved = request;
    absl::Status status = regions.Input(&resolved.k, RowElemBytes(resolved.k), "k");
    if (status.ok()) status = regions.Input(&resolved.v, RowElemBytes(resolved.v), "v");
    if (!status.ok()) {
      done(status);
      return;
    }
  }
  const WriteKvCall& call = any_region ? resolved : request;
  bool rows_fp8 = false;
  auto pages = ValidateKvRows(call.layer, call.slots, &call.k, &call.v, backend_->Geometry(),
                              limits_, &rows_fp8);
  if (!pages.ok()) {
    done(pages.status());
    return;
  }
  auto job = std::make_unique<Job>();
  if (written_ != nullptr) {
    job->on_success =
        written_->Marker(call.layer, call.slots.data(), static_cast<int64_t>(call.slots.size()), nullptr);
  }
  job->kind = Job::Kind::kWriteKv;
  job->rows.layer = call.layer;
  job->rows.slots = call.slots.data();
  job->rows.n = static_cast<int64_t>(call.slots.size());
  // The backend only reads k and v for a write.
  job->rows.k = const_cast<char*>(call.k.data.data());
  job->rows.v = const_cast<char*>(call.v.data.data());
  job->rows.k_scattered = call.k.scattered;
  job->rows.v_scattered = call.v.scattered;
  job->rows.k_on_device = call.k.on_device;
  job->rows.v_on_device = call.v.on_device;
  job->rows.rows_fp8 = rows_fp8;
  job->done = regions.Wrap(std::move(done), metrics_);
  Submit(call, *std::move(pages), {"slots", 0, "slots", call.slots.data()}, std::move(job));
}

void AttentionCore::ReadKv(const ReadKvCall& call, DoneCallback done) {
  if (absl::Status stale = CheckIncarnation(call.expected_incarnation, incarnation_);
      !stale.ok()) {
    done(stale);
    return;
  }
  const KvGeometry& g = backend_->Geometry();
  // An FP8 cache's stored bytes, unless the caller asks for its values.
  bool rows_fp8 = g.KvIsFp8() && !call.dequantize;
  auto pages = ValidateKvRows(call.layer, call.slots, nullptr, nullptr, g, limits_, &rows_fp8);
  if (!pages.ok()) {
    done(pages.status());
    return;
  }
  const int64_t n = static_cast<int64_t>(call.slots.size());
  const int64_t elem = rows_fp8 ? g.KvElemBytes() : g.QElemBytes();
  const int64_t bytes = n * g.RowElems() * elem;  // of K, and of V (none for MLA)
  if (call.out_dtype != nullptr) {
    *call.out_dtype = rows_fp8 ? TensorDTypeOf(g.kv_fp8) : TensorDTypeOf(g.dtype);
  }
  auto job = std::make_unique<Job>();
  job->kind = Job::Kind::kReadKv;
  job->rows.layer = call.layer;
  job->rows.slots = call.slots.data();
  job->rows.n = n;
  job->rows.rows_fp8 = rows_fp8;
  RegionUse regions(&regions_, call.tenant);
  if (!g.HasVPool() && call.v_region.set) {
    done(absl::InvalidArgumentError(
        "v_region must be unset: an MLA server (--attention=mla) has no V rows; k_region "
        "receives the latent rows"));
    return;
  }
  if (g.HasVPool() && call.k_region.set != call.v_region.set) {
    done(absl::InvalidArgumentError("k_region and v_region go together: set both or neither"));
    return;
  }
  if (call.k_region.set) {
    auto k = regions.Output(call.k_region, bytes, elem, "k_region");
    if (!k.ok()) {
      done(k.status());
      return;
    }
    job->rows.k = k->data;
    job->rows.k_on_device = k->on_device;
    if (g.HasVPool()) {
      auto v = regions.Output(call.v_region, bytes, elem, "v_region");
      if (!v.ok()) {
        done(v.status());
        return;
      }
      job->rows.v = v->data;
      job->rows.v_on_device = v->on_device;
    }
  } else {
    call.out_k->resize(bytes);
    job->rows.k = call.out_k->data();
    if (g.HasVPool()) {
      call.out_v->resize(bytes);
      job->rows.v = call.out_v->data();
    }
    job->held_bytes = g.HasVPool() ? 2 * bytes : bytes;
  }
  job->done = regions.Wrap(std::move(done), metrics_);
  Submit(call, *std::move(pages), {"slots", 0, "slots", call.slots.data()}, std::move(job));
}

void AttentionCore::MergeStates(const MergeStatesCall& request, DoneCallback done) {
  RegionUse regions(&regions_, request.tenant);
  MergeStatesCall resolved;
  bool any_region = request.v_region.set || request.lse_region.set;
  for (size_t i = 0; i < request.v.size() && !any_region; ++i) {
    any_region = request.v[i].region.set || request.lse[i].region.set;
  }
  if (any_region) {
    resolved = request;
    const int64_t elem = backend_->Geometry().QElemBytes();
    absl::Status status;
    for (size_t i = 0; i < resolved.v.size() && status.ok(); ++i) {
      status = regions.Input(&resolved.v[i], elem, absl::StrCat("states[", i, "].v"));
      if (status.ok()) {
        status = regions.Input(&resolved.lse[i], 4, absl::StrCat("states[", i, "].lse"));
      }
    }
    if (status.ok() && resolved.v_region.set != resolved.lse_region.set) {
      status = absl::InvalidArgumentError(
          "v_region and lse_region go together: set both or neither");
    }
    if (!status.ok()) {
      done(status);
      return;
    }
  }
  const MergeStatesCall& call = any_region ? resolved : request;
  auto shape = ValidateMerge(call, backend_->Geometry(), limits_);
  if (!shape.ok()) {
    done(shape.status());
    return;
  }
  const int64_t rows = shape->n * shape->h;
  const int64_t elem = backend_->Geometry().QElemBytes();
  char* v_out = nullptr;
  char* lse_out = nullptr;
  auto job = std::make_unique<Job>();
  if (call.v_region.set) {
    auto v = regions.Output(call.v_region, rows * shape->d * elem, elem, "v_region");
    if (!v.ok()) {
      done(v.status());
      return;
    }
    auto lse = regions.Output(call.lse_region, rows * 4, 4, "lse_region");
    if (!lse.ok()) {
      done(lse.status());
      return;
    }
    v_out = v->data;
    lse_out = lse->data;
    job->merge_on_device.v_out = v->on_device;
    job->merge_on_device.lse_out = lse->on_device;
  } else {
    call.out_v->resize(rows * shape->d * elem);
    call.out_lse->resize(rows * sizeof(float));
    v_out = call.out_v->data();
    lse_out = call.out_lse->data();
    job->held_bytes = rows * shape->d * elem + rows * static_cast<int64_t>(sizeof(float));
  }
  job->kind = Job::Kind::kMerge;
  for (size_t i = 0; i < call.v.size(); ++i) {
    job->merge_v.push_back(call.v[i].data.data());
    job->merge_lse.push_back(reinterpret_cast<const float*>(call.lse[i].data.data()));
    job->merge_on_device.v.push_back(call.v[i].on_device);
    job->merge_on_device.lse.push_back(call.lse[i].on_device);
  }
  MergeStatesParams& m = job->merge;
  m.v = job->merge_v.data();
  m.lse = job->merge_lse.data();
  m.num_states = static_cast<int32_t>(call.v.size());
  m.v_out = v_out;
  m.lse_out = reinterpret_cast<float*>(lse_out);
  m.n = shape->n;
  m.h = shape->h;
  m.d = shape->d;
  m.dtype = backend_->Geometry().dtype;
  m.lse_base_e = static_cast<uint8_t>(call.lse_base);
  job->done = regions.Wrap(std::move(done), metrics_);
  Submit(call, {}, "", std::move(job));
}

void AttentionCore::SetKvScales(const SetKvScalesCall& call, DoneCallback done) {
  if (absl::Status stale = CheckIncarnation(call.expected_incarnation, incarnation_);
      !stale.ok()) {
    done(stale);
    return;
  }
  const KvGeometry& g = backend_->Geometry();
  if (absl::Status bad = ValidateKvScales(call.layers, g); !bad.ok()) {
    done(bad);
    return;
  }
  // Each layer's scales per KV head (one value repeated over the heads).
  struct Update {
    int32_t layer;
    std::vector<float> k, v;
  };
  auto updates = std::make_shared<std::vector<Update>>();
  const size_t heads = static_cast<size_t>(g.num_kv_heads);
  for (const LayerScalesView& l : call.layers) {
    Update u{l.layer, std::vector<float>(heads), std::vector<float>(heads)};
    for (size_t h = 0; h < heads; ++h) {
      u.k[h] = l.k_scale.size() == 1 ? l.k_scale[0] : l.k_scale[h];
      u.v[h] = l.v_scale.size() == 1 ? l.v_scale[0] : l.v_scale[h];
    }
    updates->push_back(std::move(u));
  }
  auto job = std::make_unique<Job>();
  job->kind = Job::Kind::kRun;
  // On the worker, between batches: ordered with the writes and reads around
  // it. A change is refused while another tenant holds pages, whose KV was
  // quantized with the scales in force; setting the values already in force
  // changes nothing and is always allowed.
  job->run = [this, updates, tenant = call.tenant](Backend* backend) -> absl::Status {
    absl::MutexLock lock(&scales_mu_);
    const size_t heads = static_cast<size_t>(backend->Geometry().num_kv_heads);
    bool changes = false;
    for (const Update& u : *updates) {
      changes = changes ||
                !std::equal(u.k.begin(), u.k.end(), k_scales_.begin() + u.layer * heads) ||
                !std::equal(u.v.begin(), u.v.end(), v_scales_.begin() + u.layer * heads);
    }
    if (!changes) return absl::OkStatus();
    if (const int32_t others = pages_.OtherTenantsPages(tenant); others > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "SetKvScales would change the scales of KV that other tenants hold (", others,
          " pages): a layer's scales are the server's, and their FP8 rows were quantized with "
          "the scales in force; change them while no other tenant holds pages"));
    }
    for (const Update& u : *updates) {
      ATTN_RETURN_IF_ERROR(backend->SetKvScales(u.layer, u.k, u.v));
      std::copy(u.k.begin(), u.k.end(), k_scales_.begin() + u.layer * heads);
      std::copy(u.v.begin(), u.v.end(), v_scales_.begin() + u.layer * heads);
    }
    return absl::OkStatus();
  };
  job->done = std::move(done);
  Submit(call, {}, "", std::move(job));
}

std::vector<LayerScales> AttentionCore::KvScales() const {
  const KvGeometry& g = backend_->Geometry();
  std::vector<LayerScales> out;
  if (!g.KvIsFp8()) return out;
  const size_t heads = static_cast<size_t>(g.num_kv_heads);
  absl::MutexLock lock(&scales_mu_);
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    LayerScales l;
    l.layer = layer;
    l.k_scale.assign(k_scales_.begin() + layer * heads, k_scales_.begin() + (layer + 1) * heads);
    l.v_scale.assign(v_scales_.begin() + layer * heads, v_scales_.begin() + (layer + 1) * heads);
    out.push_back(std::move(l));
  }
  return out;
}

}  // namespace attnserve
