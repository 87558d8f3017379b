// AttentionCore: the layer between the gRPC edge and the backend.
//
// It validates every request (server/core/validate.h), checks page ownership
// and pins the pages a request touches, sizes the response buffers, and
// queues the work on the scheduler. It never sees a proto: the edge hands it
// the plain structs of server/core/requests.h.
//
// Asynchronous calls (Prefill, WriteKv, ReadKv, MergeStates) run `done`
// exactly once: at once with the validation error, or from one of the
// scheduler's threads (completion, finisher or worker) when the backend has
// finished.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/status/statusor.h"
#include "common/version.h"  // kVersion: CMake's project(VERSION)
#include "server/backend/backend.h"
#include "server/core/channel_table.h"
#include "server/core/lease_table.h"
#include "server/core/page_table.h"
#include "server/core/plan_table.h"
#include "server/core/region_table.h"
#include "server/core/requests.h"
#include "server/core/scheduler.h"
#include "server/core/validate.h"
#include "server/core/written_rows.h"
#include "server/metrics.h"

namespace attnserve {

struct CoreOptions {
  int32_t max_batch_tokens = 16384;
  int64_t max_queue_delay_us = 1000;
  int64_t idle_spin_us = 0;  // SchedulerOptions::idle_spin_us
  bool scrub_freed_pages = true;  // zero a freed page before it can be allocated again
  int32_t max_queue_requests = 4096;
  int32_t max_tenant_queue_requests = 0;  // 0: max_queue_requests
  int64_t max_queue_bytes = int64_t{8} << 30;  // SchedulerOptions::max_queue_bytes
  int64_t max_tenant_queue_bytes = 0;          // 0: max_queue_bytes
  int64_t max_message_bytes = 512ll << 20;
  int64_t max_request_kv_indices = 1 << 22;
  int32_t tenant_max_pages = 0;  // 0: no cap
  int32_t max_plans_per_tenant = 64;
  int64_t max_plan_bytes_per_tenant = int64_t{1} << 30;  // PlanBytes of a tenant's plans
  int64_t plan_idle_timeout_s = 300;  // a plan unused this long is released
  // Refuse a Prefill that reads KV rows never written since their page was
  // allocated (server/core/written_rows.h).
  bool check_kv_written = true;
  RegionLimits regions;  // shared-memory regions (off by default)
  ChannelLimits channels;  // request channels (in system regions)
  LeaseLimits leases;
  // How often expired leases and idle plans are released.
  absl::Duration reap_interval = absl::Milliseconds(100);
};

// Query rows (and KV rows) one request may carry: what fits in
// max_message_bytes, and never fewer than max_batch_tokens.
int32_t MaxRequestRows(const CoreOptions& options, const KvGeometry& geo);

class AttentionCore {
 public:
  AttentionCore(CoreOptions options, std::unique_ptr<Backend> backend, Metrics* metrics);
  ~AttentionCore();

  ServerInfoData Info() const;
  // Sets the gauges read only when scraped (the queue's held bytes, which
  // unsent responses release from the edge's threads).
  void SampleGauges() const;
  uint64_t incarnation() const { return incarnation_; }
  const KvGeometry& geometry() const { return backend_->Geometry(); }
  const RequestLimits& limits() const { return limits_; }

  absl::StatusOr<std::vector<int32_t>> AllocatePages(const CallContext& ctx, int32_t count);
  // Frees the pages (all or nothing). `done` runs once the ones not in use
  // are zeroed and free again; pages still pinned by requests in flight are
  // zeroed and freed when those finish. The ids must stay valid until then.
  void FreePages(const CallContext& ctx, absl::Span<const int32_t> page_ids, DoneCallback done);

  // Registers a step's layout (validated, its pages pinned) for the caller's
  // tenant and returns its plan id; Prefill calls then name it (plan_id).
  absl::StatusOr<uint64_t> CreatePlan(const CallContext& ctx, const PrefillLayout& layout,
                                      const PlanOptionsView& options = {});
  // Releases a plan: its pages are unpinned once no request uses it.
  absl::Status ReleasePlan(const CallContext& ctx, uint64_t plan_id);

  // Shared-memory regions (region_table.h), owned by ctx.tenant.
  absl::Status RegisterRegion(const CallContext& ctx, const RegionSpec& spec);
  absl::Status UnregisterRegion(const CallContext& ctx, absl::string_view name);
  std::vector<RegionInfoData> ListRegions(const CallContext& ctx);
  bool regions_enabled() const { return regions_.enabled(); }
  // A memfd a local process handed the region socket (server/region_socket/),
  // held until a RegisterRegion names its claim token (RegionTable::Deposit).
  absl::Status DepositRegion(RegionDeposit deposit) { return regions_.Deposit(std::move(deposit)); }
  // Closes the deposits that expired or whose connection closed.
  void ExpireRegionDeposits() { regions_.ExpireDeposits(); }

  // Leases (lease_table.h). GrantLease: a new lease of ctx.tenant living
  // ttl_ms (0: the default). KeepAlive renews it and returns its ttl in ms
  // (LeaseTable::ExpiredError when it is gone). RevokeLease ends it now and
  // releases what it holds (nothing when it was gone already); `done` runs
  // once the pages it freed are zeroed and free, as FreePages's does (pages
  // a running request still reads are zeroed when it finishes).
  using HoldingsCallback = std::function<void(absl::StatusOr<HoldingsData>)>;
  absl::StatusOr<LeaseTable::Granted> GrantLease(const CallContext& ctx, int64_t ttl_ms);
  absl::StatusOr<int64_t> KeepAlive(const CallContext& ctx, uint64_t lease_id);
  void RevokeLease(const CallContext& ctx, uint64_t lease_id, HoldingsCallback done);
  // What ctx.tenant holds: per lease, and unleased (lease_id 0), or under
  // one lease.
  absl::StatusOr<ListHoldingsData> ListHoldings(const CallContext& ctx, uint64_t lease_id);
  // Releases everything ctx.tenant holds, its leases included; `done` as
  // RevokeLease's.
  void ReleaseHoldings(const CallContext& ctx, HoldingsCallback done);

  // Request channels (channel_table.h): a ring in one of ctx.tenant's system
  // regions, polled by the endpoint `make` starts. Returns the channel id.
  absl::StatusOr<uint64_t> OpenChannel(const CallContext& ctx, const RegionRefView& ring,
                                       const ChannelTable::MakeEndpoint& make);
  absl::Status CloseChannel(const CallContext& ctx, uint64_t channel_id);
  // Closes every channel (the server drains or stops).
  void CloseAllChannels();

  // A tensor naming a region is read from it, and an output naming one is
  // written there: the request holds the region until `done` has run.
  void Prefill(const PrefillCall& call, DoneCallback done);
  void WriteKv(const WriteKvCall& call, DoneCallback done);
  void ReadKv(const ReadKvCall& call, DoneCallback done);
  void MergeStates(const MergeStatesCall& call, DoneCallback done);

  // FP8 caches: sets the KV scales of the call's layers (validated first;
  // all or nothing), ordered with the WriteKV, ReadKV and Prefill jobs of
  // the caller's tenant around it. FAILED_PRECONDITION when it would change
  // a scale while another tenant holds pages. `done` runs once.
  void SetKvScales(const SetKvScalesCall& call, DoneCallback done);
  // Every layer's scales (num_kv_heads each) as the last SetKvScales left
  // them, 1.0 from the start; empty for a 16-bit cache.
  std::vector<LayerScales> KvScales() const;

  // The caller of request `request_id` (CallContext) gave up: if the request
  // is still queued it leaves the queue now, its pages are unpinned and its
  // done runs with `why` (CANCELLED, or DEADLINE_EXCEEDED when its deadline
  // passed). A request already running, or unknown, is left alone.
  void Cancel(const std::string& tenant, uint64_t request_id, absl::Status why);

  // Closes every channel, finishes every queued request and stops the
  // worker; later calls get UNAVAILABLE.
  void Shutdown();

  void SetFaultHandler(std::function<void(const absl::Status&)> handler) {
    scheduler_->SetFaultHandler(std::move(handler));
  }

  int64_t batches_run() const { return scheduler_->batches_run(); }

 private:
  struct PendingRelease;
  // Pins `pages` for `tenant` and queues `job`; on any error runs done.
  template <typename CallT>
  void Submit(const CallT& call, std::vector<int32_t> pages, const PageTable::PinNames& names,
              std::unique_ptr<Job> job);
  void UpdatePageGauges();
  // Renews ctx's lease when it names one (a request naming a lease keeps it
  // alive); LeaseTable::ExpiredError when it is gone.
  absl::Status RenewLease(const CallContext& ctx);
  // Releases what `tenant` holds under `lease` (0: everything it holds):
  // channels closed, regions unregistered, plans released (and any other
  // plan that names a page freed here), pages freed and zeroed (`zeroed`,
  // if any, runs when they are). Under lease_mu_ held exclusively.
  HoldingsData ReleaseHeld(const std::string& tenant, uint64_t lease, DoneCallback zeroed = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(lease_mu_);
  void CountRelease(Metrics::Release why, int64_t leases, const HoldingsData& released);
  // Every reap_interval: expired leases released, idle plans released.
  void ReapLoop();
  void UpdateRegionGauges(const std::string& tenant);
  void UpdateChannelGauge(const std::string& tenant);
  // Request-side region bookkeeping: the slices a request holds, checked for
  // overlaps of an output with anything else, and the bytes per path.
  class RegionUse;

  const CoreOptions options_;
  const std::unique_ptr<Backend> backend_;
  Metrics* const metrics_;
  const uint64_t incarnation_;
  RequestLimits limits_;
  // FP8 caches: (num_layers, num_kv_heads) KV scales as the backend has
  // them (SetKvScales updates both on the worker).
  mutable absl::Mutex scales_mu_;
  std::vector<float> k_scales_ ABSL_GUARDED_BY(scales_mu_);
  std::vector<float> v_scales_ ABSL_GUARDED_BY(scales_mu_);
  PageTable pages_;
  std::unique_ptr<WrittenRows> written_;  // null: --check_kv_written=false
  std::unique_ptr<Scheduler> scheduler_;
  // After scheduler_: a plan going away unpins its pages through both.
  PlanTable plans_;
  RegionTable regions_;
  // After regions_: a region dropped closes its channels, and the channels'
  // endpoints go (closing) before the regions they hold.
  ChannelTable channels_;
  LeaseTable leases_;
  // Held shared by the calls that put something under a lease (from the
  // lease's renewal to the entry made), exclusively while a lease's holdings
  // are released: nothing is added under a lease that has ended.
  absl::Mutex lease_mu_;
  absl::Notification stop_reaper_;
  std::thread reaper_;  // last: started once everything above exists
};

}  // namespace attnserve
