// Metrics: the Prometheus families of docs/design.md section 7, built once on one
// registry. Components keep a pointer to Metrics and update it; the exposer
// (server/grpc/server.cc) serves the registry on --metrics_listen, with the
// process's own series (server/process_metrics.h).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace attnserve {

class Metrics {
 public:
  Metrics();

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // The RPCs of attnserve.v1.AttentionService (the `method` label).
  enum class Rpc {
    kGetServerInfo, kAllocatePages, kFreePages, kWriteKV, kReadKV, kPrefill, kMergeStates,
    kCreatePlan, kReleasePlan, kRegisterRegion, kUnregisterRegion, kListRegions, kOpenChannel,
    kCloseChannel, kGrantLease, kKeepAlive, kRevokeLease, kListHoldings, kReleaseHoldings,
    kSetKvScales, kGetKvScales, kCount
  };
  static const char* RpcName(Rpc rpc);
  // The `shape` label: kDecode for a Prefill whose every sequence has at most
  // 8 query rows, kPrefill for other Prefills, kNone for the other RPCs.
  enum class Shape { kNone, kDecode, kPrefill, kCount };

  // One finished RPC with its status code (gRPC's numbering) and the
  // handler's wall time in seconds. Each (method, code, shape) series is
  // created on first use and then updated without a lookup.
  void ObserveRequest(Rpc rpc, absl::StatusCode code, Shape shape, double seconds);
  // Requests queued in the scheduler, all tenants.
  void SetQueueDepth(int64_t requests) { queue_depth_->Set(static_cast<double>(requests)); }
  void SetQueueHeldBytes(int64_t bytes) { queue_held_bytes_->Set(static_cast<double>(bytes)); }
  // Pages a tenant holds.
  void SetTenantPages(const std::string& tenant, int64_t pages);
  // Bytes of the KV cache (K and V, every layer and page), either backend.
  void SetKvCacheBytes(int64_t bytes) { kv_cache_bytes_->Set(static_cast<double>(bytes)); }
  // The device's memory in use and in all (CUDA backend only: the CPU backend
  // has no device, and these families are not exported there).
  void SetDeviceMemory(int64_t used_bytes, int64_t total_bytes);
  // Tenants known at start (--auth_tokens_file, or "default"): their
  // per-tenant series exist from then on, at 0, instead of appearing on
  // first use.
  void AddTenants(const std::vector<std::string>& tenants);
  // attnserve_build_info{version, commit, backend, device, prefill_kernel,
  // kv_dtype, q_dtype} = 1.
  void SetBuildInfo(const std::string& version, const std::string& commit,
                    const std::string& backend, const std::string& device,
                    const std::string& prefill_kernel, const std::string& kv_dtype,
                    const std::string& q_dtype);
  void ObserveQueueWait(double seconds) { queue_wait_->Observe(seconds); }
  // One attention launch: requests and query rows in it.
  void ObserveBatch(int requests, int64_t query_rows);
  // The `kernel` label; its values are disjoint, so a sum over them is the
  // whole. attention_prefill: the prefill family's attention launches (every
  // attention launch on the CPU backend); attention_decode: the decode
  // family's; merge: the split-KV merge; append: a Prefill batch's fused
  // appends; kv_rows: WriteKV scatters and ReadKV gathers; zero_pages: freed
  // pages zeroed before reuse; attention_mla: every attention launch of an
  // MLA server (--attention=mla: the MLA family on CUDA, the CPU backend's
  // MLA attention), where attention_prefill and attention_decode stay 0.
  enum class Kernel {
    kAttentionPrefill,
    kAttentionDecode,
    kMerge,
    kAppend,
    kKvRows,
    kZeroPages,
    kAttentionMla
  };
  static constexpr int kNumKernels = 7;
  // Launches of one kernel in a batch and their device (or CPU) seconds.
  void ObserveKernel(Kernel kernel, int launches, double seconds);
  // Host time of one batch stage: submit (plan, pack, queue), wait (for the
  // device), unpack (outputs to the responses), finish (pages unpinned,
  // responses handed to gRPC).
  enum class Stage { kSubmit, kWait, kUnpack, kFinish };
  void ObserveStage(Stage stage, double seconds);
  // Host time of one Prefill request outside its batch, by stage: parse (the
  // edge reads the request), admit (the core validates it, resolves its
  // regions, pins its pages and queues it), respond (from the core's done
  // callback to the response handed to gRPC), send (from then until gRPC
  // reports the call done). With queue_wait and the batch stages it accounts
  // for a request's time in the server.
  enum class RequestStage { kParse, kAdmit, kRespond, kSend };
  void ObserveRequestStage(RequestStage stage, double seconds);
  void SetKvPages(int64_t free_pages, int64_t used_pages);
  // Prefill requests whose attention the backend stopped because their
  // caller had given up (a cancelled call, its deadline passed).
  void AddGivenUp(int tasks);
  // Bytes moved, by path: kInline counts whole requests and responses
  // (tensors and framing); kSystem and kCuda the tensor bytes that
  // successful requests read from and wrote to regions of that kind.
  enum class Path { kInline, kSystem, kCuda };
  void AddTransferBytes(int64_t in_bytes, int64_t out_bytes, Path path = Path::kInline);
  // Regions a tenant holds and their bytes.
  void SetTenantRegions(const std::string& tenant, int64_t count, int64_t bytes);
  // Request channels a tenant has open.
  void SetOpenChannels(const std::string& tenant, int64_t count);
  prometheus::Gauge& inflight() { return *inflight_; }
  // Leases a tenant holds.
  void SetTenantLeases(const std::string& tenant, int64_t count);
  // Why holdings were released: their lease expired (not renewed within its
  // ttl), was revoked (RevokeLease), or the tenant released everything
  // (ReleaseHoldings).
  enum class Release { kExpired, kRevoked, kReleaseHoldings };
  // Leases that ended for `why`, and the pages, plans, regions and channels
  // released with them.
  void ObserveRelease(Release why, int64_t leases, int64_t pages, int64_t plans, int64_t regions,
                      int64_t channels);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  static constexpr int kRpcs = static_cast<int>(Rpc::kCount);
  static constexpr int kCodes = 17;  // gRPC's codes 0..16
  static constexpr int kShapes = static_cast<int>(Shape::kCount);
  prometheus::Family<prometheus::Counter>* requests_total_;
  prometheus::Family<prometheus::Histogram>* request_duration_;
  prometheus::Family<prometheus::Gauge>* tenant_pages_;
  prometheus::Family<prometheus::Gauge>* tenant_regions_;
  prometheus::Family<prometheus::Gauge>* tenant_region_bytes_;
  prometheus::Family<prometheus::Gauge>* open_channels_;
  prometheus::Family<prometheus::Gauge>* build_info_;
  absl::Mutex series_mu_;  // creates the lazily made series below
  // The (method rpc, code c, shape sh) series of both request families.
  void AddRequestSeries(int r, int c, int sh, prometheus::Counter** counter,
                        prometheus::Histogram** duration) ABSL_EXCLUSIVE_LOCKS_REQUIRED(series_mu_);
  std::atomic<prometheus::Counter*> requests_[kRpcs][kCodes][kShapes] = {};
  std::atomic<prometheus::Histogram*> durations_[kRpcs][kShapes] = {};
  prometheus::Gauge* queue_depth_;
  prometheus::Gauge* queue_held_bytes_;
  prometheus::Gauge* kv_cache_bytes_;
  prometheus::Gauge* memory_used_ = nullptr;   // registered by SetDeviceMemory
  prometheus::Gauge* memory_total_ = nullptr;
  prometheus::Histogram* queue_wait_;
  prometheus::Histogram* batch_requests_;
  prometheus::Histogram* batch_query_rows_;
  // Series of the fixed label values, indexed by Kernel and Stage: created
  // once, so a batch's observations look nothing up.
  prometheus::Counter* kernel_launches_[kNumKernels];
  prometheus::Histogram* kernel_duration_[kNumKernels];
  prometheus::Histogram* batch_stage_[4];
  prometheus::Histogram* request_stage_[4];
  prometheus::Gauge* kv_free_;
  prometheus::Gauge* kv_used_;
  prometheus::Counter* bytes_in_[3];
  prometheus::Counter* bytes_out_[3];
  prometheus::Gauge* inflight_;
  prometheus::Family<prometheus::Gauge>* tenant_leases_;
  prometheus::Counter* leases_ended_[3];
  prometheus::Counter* given_up_;
  prometheus::Counter* released_[3][4];  // [Release][pages, plans, regions, channels]
};

}  // namespace attnserve
