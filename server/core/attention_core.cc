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
  if (options.check_kv_written) {
    written_ = std::make_unique<WrittenRows>(backend_->Geometry());
    // A page's rows count as unwritten from the moment it can be allocated
    // again: cleared at allocation instead, a request or plan of the new
    // owner racing the AllocatePages call could find the old owner's bits.
    pages_.SetFreeListener([written = written_.get()](absl::Span<const int32_t> pages) {
      written->Reset(pages);
    });
  }
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
  info.fp8_query_min_rows = backend_->Fp8QueryMinRows();
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

}  // namespace attnserve
