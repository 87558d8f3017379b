#include "server/metrics.h"

#include <algorithm>
#include <vector>

namespace attnserve {
namespace {

// Exponential buckets: start, start*factor, ... (count of them).
prometheus::Histogram::BucketBoundaries Exponential(double start, double factor, int count) {
  prometheus::Histogram::BucketBoundaries b;
  double v = start;
  for (int i = 0; i < count; ++i, v *= factor) b.push_back(v);
  return b;
}

// 1 us .. ~34 s in steps of 2x: resolves queue waits, small kernels and
// 16k-row prefills alike.
prometheus::Histogram::BucketBoundaries Seconds() { return Exponential(1e-6, 2.0, 26); }

}  // namespace

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  requests_total_ = &prometheus::BuildCounter()
                         .Name("attnserve_requests_total")
                         .Help("RPCs finished, by method, gRPC status code and request shape")
                         .Register(*registry_);
  request_duration_ = &prometheus::BuildHistogram()
                           .Name("attnserve_request_duration_seconds")
                           .Help("Server-side RPC latency in seconds, by method and request shape")
                           .Register(*registry_);
  // Both request families exist from the start: each method's OK series at
  // 0 (a Prefill's for both its shapes), the others as they occur.
  {
    absl::MutexLock lock(&series_mu_);
    for (int r = 0; r < kRpcs; ++r) {
      const bool prefill = static_cast<Rpc>(r) == Rpc::kPrefill;
      for (Shape sh : prefill ? std::vector<Shape>{Shape::kDecode, Shape::kPrefill}
                              : std::vector<Shape>{Shape::kNone}) {
        prometheus::Counter* counter = nullptr;
        prometheus::Histogram* duration = nullptr;
        AddRequestSeries(r, static_cast<int>(absl::StatusCode::kOk), static_cast<int>(sh),
                         &counter, &duration);
      }
    }
  }
  queue_depth_ = &prometheus::BuildGauge()
                      .Name("attnserve_queue_depth")
                      .Help("Requests queued in the scheduler, all tenants")
                      .Register(*registry_)
                      .Add({});
  queue_held_bytes_ = &prometheus::BuildGauge()
                          .Name("attnserve_queue_held_bytes")
                          .Help("Bytes of server memory that queued and running requests and unsent responses "
                                "hold (bounded by --max_queue_bytes), sampled at each scrape")
                          .Register(*registry_)
                          .Add({});
  tenant_pages_ = &prometheus::BuildGauge()
                       .Name("attnserve_tenant_kv_pages")
                       .Help("KV cache pages held, by tenant")
                       .Register(*registry_);
  kv_cache_bytes_ = &prometheus::BuildGauge()
                         .Name("attnserve_kv_cache_bytes")
                         .Help("Bytes of the KV cache (K and V of every layer and page)")
                         .Register(*registry_)
                         .Add({});
  build_info_ = &prometheus::BuildGauge()
                     .Name("attnserve_build_info")
                     .Help("1, labelled with the server's version, commit, backend, device, prefill kernel family and KV and query dtypes")
                     .Register(*registry_);
  queue_wait_ = &prometheus::BuildHistogram()
                     .Name("attnserve_queue_wait_seconds")
                     .Help("Time a request waited in the scheduler queue, seconds")
                     .Register(*registry_)
                     .Add({}, Seconds());
  batch_requests_ = &prometheus::BuildHistogram()
                         .Name("attnserve_batch_requests")
                         .Help("Requests per attention launch")
                         .Register(*registry_)
                         .Add({}, Exponential(1, 2, 11));
  batch_query_rows_ = &prometheus::BuildHistogram()
                           .Name("attnserve_batch_query_rows")
                           .Help("Query rows per attention launch")
                           .Register(*registry_)
                           .Add({}, Exponential(1, 2, 18));
  auto& kernel_launches = prometheus::BuildCounter()
                          .Name("attnserve_kernel_launches_total")
                          .Help("Kernel launches by kernel (attention_prefill, attention_decode, "
                                "attention_mla, merge, append, kv_rows, zero_pages; disjoint)")
                          .Register(*registry_);
  auto& kernel_duration = prometheus::BuildHistogram()
                          .Name("attnserve_kernel_duration_seconds")
                          .Help("Kernel time per batch in seconds (device time on CUDA)")
                          .Register(*registry_);
  auto& batch_stage = prometheus::BuildHistogram()
                      .Name("attnserve_batch_stage_seconds")
                      .Help("Host time per batch by stage (submit, wait, unpack, finish)")
                      .Register(*registry_);
  auto& request_stage = prometheus::BuildHistogram()
                        .Name("attnserve_request_stage_seconds")
                        .Help("Host time per Prefill request outside its batch by stage (parse, "
                              "admit, respond, send)")
                        .Register(*registry_);
  auto& pages = prometheus::BuildGauge()
                    .Name("attnserve_kv_pages")
                    .Help("KV cache pages by state")
                    .Register(*registry_);
  kv_free_ = &pages.Add({{"state", "free"}});
  kv_used_ = &pages.Add({{"state", "used"}});
  auto& bytes = prometheus::BuildCounter()
                    .Name("attnserve_transfer_bytes_total")
                    .Help("Bytes received (in) and sent (out): whole requests and responses "
                          "(path inline), tensor bytes in shared-memory regions (system, cuda)")
                    .Register(*registry_);
  static const char* const kPaths[] = {"inline", "system", "cuda"};
  for (int p = 0; p < 3; ++p) {
    bytes_in_[p] = &bytes.Add({{"direction", "in"}, {"path", kPaths[p]}});
    bytes_out_[p] = &bytes.Add({{"direction", "out"}, {"path", kPaths[p]}});
  }
  tenant_regions_ = &prometheus::BuildGauge()
                         .Name("attnserve_tenant_regions")
                         .Help("Shared-memory regions a tenant holds")
                         .Register(*registry_);
  tenant_region_bytes_ = &prometheus::BuildGauge()
                             .Name("attnserve_tenant_region_bytes")
                             .Help("Bytes of the shared-memory regions a tenant holds")
                             .Register(*registry_);
  open_channels_ = &prometheus::BuildGauge()
                       .Name("attnserve_open_channels")
                       .Help("Request channels a tenant has open (OpenChannel)")
                       .Register(*registry_);
  inflight_ = &prometheus::BuildGauge()
                   .Name("attnserve_inflight_requests")
                   .Help("RPCs being handled")
                   .Register(*registry_)
                   .Add({});
  tenant_leases_ = &prometheus::BuildGauge()
                        .Name("attnserve_tenant_leases")
                        .Help("Leases a tenant holds (GrantLease)")
                        .Register(*registry_);
  auto& leases_ended = prometheus::BuildCounter()
                           .Name("attnserve_leases_ended_total")
                           .Help("Leases ended, by reason (expired: not renewed within the ttl; "
                                 "revoked: RevokeLease; release_holdings: ReleaseHoldings)")
                           .Register(*registry_);
  given_up_ = &prometheus::BuildCounter()
                   .Name("attnserve_given_up_requests_total")
                   .Help("Prefill requests whose attention the backend stopped, or never began, "
                         "because their caller had given up (cancelled, or its deadline passed) "
                         "while their batch ran (the CPU backend)")
                   .Register(*registry_)
                   .Add({});
  auto& released = prometheus::BuildCounter()
                       .Name("attnserve_holdings_released_total")
                       .Help("Pages, plans, regions and channels released with a lease or by "
                             "ReleaseHoldings, by kind and reason")
                       .Register(*registry_);
  const char* reasons[] = {"expired", "revoked", "release_holdings"};
  const char* kinds[] = {"pages", "plans", "regions", "channels"};
  for (int r = 0; r < 3; ++r) {
    leases_ended_[r] = &leases_ended.Add({{"reason", reasons[r]}});
    for (int k = 0; k < 4; ++k) released_[r][k] = &released.Add({{"kind", kinds[k]}, {"reason", reasons[r]}});
  }
  // The kernel and stage series exist from the start (dashboards see them at
  // zero), in the order of the Kernel and Stage enums.
  const char* kernels[] = {"attention_prefill", "attention_decode", "merge", "append", "kv_rows",
                           "zero_pages", "attention_mla"};
  static_assert(sizeof(kernels) / sizeof(kernels[0]) == kNumKernels);
  for (int i = 0; i < kNumKernels; ++i) {
    kernel_launches_[i] = &kernel_launches.Add({{"kernel", kernels[i]}});
    kernel_duration_[i] = &kernel_duration.Add({{"kernel", kernels[i]}}, Seconds());
  }
  const char* stages[] = {"submit", "wait", "unpack", "finish"};
  for (int i = 0; i < 4; ++i) batch_stage_[i] = &batch_stage.Add({{"stage", stages[i]}}, Seconds());
  const char* request_stages[] = {"parse", "admit", "respond", "send"};
  for (int i = 0; i < 4; ++i) {
    request_stage_[i] = &request_stage.Add({{"stage", request_stages[i]}}, Seconds());
  }
}

const char* Metrics::RpcName(Rpc rpc) {
  switch (rpc) {
    case Rpc::kGetServerInfo: return "GetServerInfo";
    case Rpc::kAllocatePages: return "AllocatePages";
    case Rpc::kFreePages: return "FreePages";
    case Rpc::kWriteKV: return "WriteKV";
    case Rpc::kReadKV: return "ReadKV";
    case Rpc::kPrefill: return "Prefill";
    case Rpc::kMergeStates: return "MergeStates";
    case Rpc::kCreatePlan: return "CreatePlan";
    case Rpc::kReleasePlan: return "ReleasePlan";
    case Rpc::kRegisterRegion: return "RegisterRegion";
    case Rpc::kUnregisterRegion: return "UnregisterRegion";
    case Rpc::kListRegions: return "ListRegions";
    case Rpc::kOpenChannel: return "OpenChannel";
    case Rpc::kCloseChannel: return "CloseChannel";
    case Rpc::kGrantLease: return "GrantLease";
    case Rpc::kKeepAlive: return "KeepAlive";
    case Rpc::kRevokeLease: return "RevokeLease";
    case Rpc::kListHoldings: return "ListHoldings";
    case Rpc::kReleaseHoldings: return "ReleaseHoldings";
    case Rpc::kSetKvScales: return "SetKvScales";
    case Rpc::kGetKvScales: return "GetKvScales";
    case Rpc::kCount: break;
  }
  return "unknown";
}

void Metrics::ObserveRequest(Rpc rpc, absl::StatusCode code, Shape shape, double seconds) {
  const int r = static_cast<int>(rpc);
  const int c = std::clamp(static_cast<int>(code), 0, kCodes - 1);
  const int sh = static_cast<int>(shape);
  prometheus::Counter* counter = requests_[r][c][sh].load(std::memory_order_acquire);
  prometheus::Histogram* duration = durations_[r][sh].load(std::memory_order_acquire);
  if (counter == nullptr || duration == nullptr) {
    absl::MutexLock lock(&series_mu_);
    AddRequestSeries(r, c, sh, &counter, &duration);
  }
  counter->Increment();
  duration->Observe(seconds);
}

void Metrics::AddRequestSeries(int r, int c, int sh, prometheus::Counter** counter,
                               prometheus::Histogram** duration) {
  static const char* const kShapeNames[] = {"none", "decode", "prefill"};
  const std::string method = RpcName(static_cast<Rpc>(r));
  *counter = &requests_total_->Add({{"method", method},
                                    {"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(c))},
                                    {"shape", kShapeNames[sh]}});
  *duration = &request_duration_->Add({{"method", method}, {"shape", kShapeNames[sh]}}, Seconds());
  requests_[r][c][sh].store(*counter, std::memory_order_release);
  durations_[r][sh].store(*duration, std::memory_order_release);
}

void Metrics::SetTenantPages(const std::string& tenant, int64_t pages) {
  absl::MutexLock lock(&series_mu_);
  tenant_pages_->Add({{"tenant", tenant}}).Set(static_cast<double>(pages));
}

void Metrics::SetDeviceMemory(int64_t used_bytes, int64_t total_bytes) {
  {
    absl::MutexLock lock(&series_mu_);
    if (memory_used_ == nullptr) {
      memory_used_ = &prometheus::BuildGauge()
                          .Name("attnserve_device_memory_used_bytes")
                          .Help("Memory of the server's GPU in use (KV cache, workspace, CUDA "
                                "context and anything else on the device), bytes")
                          .Register(*registry_)
                          .Add({});
      memory_total_ = &prometheus::BuildGauge()
                           .Name("attnserve_device_memory_total_bytes")
                           .Help("Memory of the server's GPU in all, bytes")
                           .Register(*registry_)
                           .Add({});
    }
  }
  memory_used_->Set(static_cast<double>(used_bytes));
  memory_total_->Set(static_cast<double>(total_bytes));
}

void Metrics::AddTenants(const std::vector<std::string>& tenants) {
  absl::MutexLock lock(&series_mu_);
  for (const std::string& tenant : tenants) {
    // Add returns the series when it exists already: a value set meanwhile stays.
    tenant_pages_->Add({{"tenant", tenant}});
    tenant_regions_->Add({{"tenant", tenant}});
    tenant_region_bytes_->Add({{"tenant", tenant}});
    open_channels_->Add({{"tenant", tenant}});
    tenant_leases_->Add({{"tenant", tenant}});
  }
}

void Metrics::SetBuildInfo(const std::string& version, const std::string& commit,
                           const std::string& backend, const std::string& device,
                           const std::string& prefill_kernel, const std::string& kv_dtype,
                           const std::string& q_dtype) {
  absl::MutexLock lock(&series_mu_);
  build_info_->Add({{"version", version}, {"commit", commit}, {"backend", backend},
                    {"device", device}, {"prefill_kernel", prefill_kernel},
                    {"kv_dtype", kv_dtype}, {"q_dtype", q_dtype}})
      .Set(1);
}

void Metrics::ObserveBatch(int requests, int64_t query_rows) {
  batch_requests_->Observe(requests);
  batch_query_rows_->Observe(static_cast<double>(query_rows));
}

void Metrics::ObserveKernel(Kernel kernel, int launches, double seconds) {
  if (launches <= 0) return;
  kernel_launches_[static_cast<int>(kernel)]->Increment(launches);
  kernel_duration_[static_cast<int>(kernel)]->Observe(seconds);
}

void Metrics::AddGivenUp(int tasks) {
  if (tasks > 0) given_up_->Increment(tasks);
}

void Metrics::ObserveStage(Stage stage, double seconds) {
  batch_stage_[static_cast<int>(stage)]->Observe(seconds);
}

void Metrics::ObserveRequestStage(RequestStage stage, double seconds) {
  request_stage_[static_cast<int>(stage)]->Observe(seconds);
}

void Metrics::SetKvPages(int64_t free_pages, int64_t used_pages) {
  kv_free_->Set(static_cast<double>(free_pages));
  kv_used_->Set(static_cast<double>(used_pages));
}

void Metrics::AddTransferBytes(int64_t in_bytes, int64_t out_bytes, Path path) {
  const int p = static_cast<int>(path);
  if (in_bytes > 0) bytes_in_[p]->Increment(static_cast<double>(in_bytes));
  if (out_bytes > 0) bytes_out_[p]->Increment(static_cast<double>(out_bytes));
}

void Metrics::SetTenantRegions(const std::string& tenant, int64_t count, int64_t bytes) {
  absl::MutexLock lock(&series_mu_);
  tenant_regions_->Add({{"tenant", tenant}}).Set(static_cast<double>(count));
  tenant_region_bytes_->Add({{"tenant", tenant}}).Set(static_cast<double>(bytes));
}

void Metrics::SetOpenChannels(const std::string& tenant, int64_t count) {
  absl::MutexLock lock(&series_mu_);
  open_channels_->Add({{"tenant", tenant}}).Set(static_cast<double>(count));
}

void Metrics::SetTenantLeases(const std::string& tenant, int64_t count) {
  absl::MutexLock lock(&series_mu_);
  tenant_leases_->Add({{"tenant", tenant}}).Set(static_cast<double>(count));
}

void Metrics::ObserveRelease(Release why, int64_t leases, int64_t pages, int64_t plans,
                             int64_t regions, int64_t channels) {
  const int r = static_cast<int>(why);
  if (leases > 0) leases_ended_[r]->Increment(static_cast<double>(leases));
  const int64_t counts[] = {pages, plans, regions, channels};
  for (int k = 0; k < 4; ++k) {
    if (counts[k] > 0) released_[r][k]->Increment(static_cast<double>(counts[k]));
  }
}

}  // namespace attnserve
