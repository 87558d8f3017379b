// attnserve C++ client: typed calls over spans.
//
//   auto client = attnserve::Client::Connect({.target = "127.0.0.1:50051"});
//   auto pages = (*client)->AllocatePages(4);
//   (*client)->WriteKV(/*layer=*/0, slots, k, v);
//   auto out = (*client)->Prefill(args);   // out->o, out->lse
//
// Tensors are raw 16-bit values (bf16 or fp16, as the server's q_dtype) and
// float32 LSEs; on an FP8 server K and V rows may also be FP8 bytes as the
// cache stores them (WriteKVFp8, ReadKV without dequantize). Errors come back
// as absl::Status with the server's code and message.
//
// Restart safety: the client remembers the server's incarnation from its
// first answer and sends it as expected_incarnation with every later request
// that names pages or slots. After a server restart those requests fail with
// FAILED_PRECONDITION instead of touching pages that may now belong to
// someone else; ForgetIncarnation() accepts the new server once the caller
// has dropped what it held. The client keeps the geometry it connected to
// (info()): GetServerInfo() refuses a server back with another one
// (FAILED_PRECONDITION, kAnotherGeometry), which needs a new Client; after
// ForgetIncarnation() the next call naming pages or slots reads it first.
//
// Leases (docs/security.md, "Leases"): with UseLease(id), every request that
// takes a lease names it: what AllocatePages, CreatePlan, RegisterRegion and
// OpenChannel make is held under it, and the pages and plans a request uses
// must be. A LeaseKeeper (client/lease.h) grants one and keeps it alive.
// Fork() gives a client of its own lease over the same connection.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "common/kv_geometry.h"
#include "common/unique_fd.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/client_interceptor.h"

namespace attnserve {

class BorrowedMemory;
class RequestChannel;
class SharedMemory;
struct ChannelOptions;

struct ClientOptions {
  std::string target = "127.0.0.1:50051";
  std::string token;            // sent as "authorization: Bearer TOKEN" when set
  bool tls = false;             // implied by tls_ca or tls_cert (UsesTls)
  std::string tls_ca;           // PEM file of the server's CA (TLS; without it, the system's roots)
  std::string tls_cert;         // PEM client certificate (mTLS, with tls_key)
  std::string tls_key;          // PEM client key (mTLS)
  int64_t max_message_bytes = 512ll << 20;  // 1 .. 2^31 - 1
  double timeout_s = 0;         // per-call deadline; 0: none (finite, >= 0)
  // Connect waits at most this long for the server to answer. A cause gRPC
  // names (connection refused, a host that does not resolve, a TLS mismatch,
  // an HTTP/1 port such as the metrics one) fails at once with UNAVAILABLE
  // saying so; only an address whose connection is still in progress, or
  // failed for no named cause, is waited for.
  double connect_timeout_s = 10;  // finite, > 0 (Connect refuses others, naming them)
  // gRPC's HTTP/2 and TCP settings for large tensors (common/transport.h);
  // false: gRPC's defaults. grpc_args: "NAME=INT,..." applied after them.
  bool transport_tuning = true;
  std::string grpc_args;
  // The tensor-carrying calls (Prefill, WriteKV, ReadKV, MergeStates) wait
  // for their response by polling gRPC's completion queue in a loop instead
  // of sleeping: the response is taken without a thread wake-up (tens of
  // microseconds on an idle host) at the cost of a busy core while a call
  // waits. For per-layer calls on a latency-critical path.
  bool busy_poll = false;
  // Read the geometry (GetServerInfo) at connect time. Health checks need no
  // credentials and skip it.
  bool fetch_info = true;
  // For tests: when set, called with the target once per connection for
  // gRPC client interceptors that see every call on it
  // (tests/client/fault_injection.h injects failures with them). Forks
  // share the connection and its interceptors.
  std::function<std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>>(
      const std::string& target)>
      interceptors;
};

// A byte range of a registered shared-memory region (docs/transport.md),
// named by a tensor instead of its bytes.
struct RegionRef {
  std::string name;
  int64_t offset = 0;
  int64_t byte_size = 0;
};

// Attention variants (docs/design.md, "Variants"): the API's
// AttentionOptions. An unset field takes the value its plan gives the
// request's layer (a Prefill naming a plan), else the default; a set one
// that contradicts the plan's is INVALID_ARGUMENT.
struct AttentionOptions {
  // Sliding window: a query row at position p sees no key before
  // p - window_left (with the causal mask: p - window_left .. p). -1: none.
  std::optional<int32_t> window_left;
  // > 0: a scaled logit x becomes logits_soft_cap * tanh(x / logits_soft_cap)
  // (Gemma 2's). 0: none; otherwise in [1e-30, 1e30].
  std::optional<float> logits_soft_cap;
  // (num_qo_heads) or empty: one logit per query head, natural units, that
  // enters the softmax denominator only (gpt-oss); the LSE includes it. -inf
  // is no sink for that head.
  std::vector<float> sinks;

  bool empty() const { return !window_left && !logits_soft_cap && sinks.empty(); }
};

struct PrefillArgs {
  int32_t layer = 0;
  absl::Span<const uint16_t> q;                // (total_q, num_qo_heads, head_dim)
  absl::Span<const int32_t> qo_indptr;
  absl::Span<const int32_t> kv_indptr;
  absl::Span<const int32_t> kv_indices;
  absl::Span<const int32_t> kv_last_page_len;
  std::optional<float> sm_scale;
  std::optional<bool> causal;
  bool lse_base_e = false;
  absl::Span<const int64_t> append_slots;
  absl::Span<const uint16_t> append_k;         // (n, num_kv_heads, head_dim)
  absl::Span<const uint16_t> append_v;
  // Or, on an FP8 server, the rows as its cache stores them (FP8 bytes of
  // its kv_dtype), instead of append_k / append_v (which then stay empty).
  absl::Span<const uint8_t> append_k_fp8;
  absl::Span<const uint8_t> append_v_fp8;
  uint64_t expected_incarnation = 0;  // 0: the client's remembered incarnation
  uint64_t lease_id = 0;              // 0: the client's lease (UseLease), if any
  // A plan from CreatePlan: then qo_indptr .. kv_last_page_len,
  // append_slots and kv_keys_after stay empty, and append_k/append_v have
  // the plan's rows.
  uint64_t plan_id = 0;
  // Tensors in regions instead of the spans above (which then stay empty).
  // With a region q, total_q comes from q_rows.
  std::optional<RegionRef> q_region;
  int64_t q_rows = 0;
  std::optional<RegionRef> append_k_region;  // rows: append_slots.size(), or append_rows
  std::optional<RegionRef> append_v_region;
  int64_t append_rows = 0;
  // Both or neither: the output and the LSE are written there, and the
  // result's o and lse stay empty.
  std::optional<RegionRef> output_region;
  std::optional<RegionRef> lse_region;
  // (batch) or empty: keys of each sequence held after this request's range
  // (a sequence spread over servers; docs/design.md section 3).
  absl::Span<const int32_t> kv_keys_after;
  // Sliding window, soft-cap, sinks (with a plan: must agree with the plan's
  // for this layer).
  AttentionOptions options;
  // (batch) or empty (all 1): 0 where options.sinks do not enter sequence b
  // (a sequence spread over servers takes its sinks on one of them only).
  absl::Span<const uint8_t> apply_sinks;
};

// A step's layout for CreatePlan (the same arrays as PrefillArgs), and the
// attention options of every layer's Prefill that names it.
struct PlanLayout {
  absl::Span<const int32_t> qo_indptr;
  absl::Span<const int32_t> kv_indptr;
  absl::Span<const int32_t> kv_indices;
  absl::Span<const int32_t> kv_last_page_len;
  absl::Span<const int64_t> append_slots;
  absl::Span<const int32_t> kv_keys_after;  // (batch) or empty
  absl::Span<const uint8_t> apply_sinks;    // (batch) or empty (all 1)
  // The options of every layer, but those of the layers in layer_options,
  // which replace them for that layer (e.g. windowed and full layers).
  AttentionOptions options;
  std::map<int32_t, AttentionOptions> layer_options;
};

struct PrefillResult {
  std::vector<uint16_t> o;  // (total_q, num_qo_heads, head_dim)
  std::vector<float> lse;   // (total_q, num_qo_heads)
  uint64_t incarnation = 0;
};

struct KvData {
  std::vector<uint16_t> k;  // (n, num_kv_heads, head_dim): 16-bit rows (q_dtype)
  std::vector<uint16_t> v;
  // An FP8 server's stored bytes (ReadKV without dequantize), k and v empty
  // then; empty otherwise.
  std::vector<uint8_t> k_fp8;
  std::vector<uint8_t> v_fp8;
};

// One layer's KV scales of an FP8 server (SetKvScales, GetKvScales): 1 entry
// (the whole layer) or num_kv_heads entries each; real = fp8 value x scale.
struct LayerKvScales {
  int32_t layer = 0;
  std::vector<float> k_scale;
  std::vector<float> v_scale;
};

struct State {
  std::vector<uint16_t> v;  // (n, h, d)
  std::vector<float> lse;   // (n, h)
};

// The KV geometry a server reports (dtype: its q_dtype; kv_fp8: its
// kv_dtype when that is FP8).
KvGeometry GeometryOf(const v1::ServerInfo& info);

// "" when b's geometry is a's (num_pages may differ), else what differs:
// "page_size=8 (A_IS 16), ...", each field of b with a's beside it.
std::string GeometryDifference(const KvGeometry& a, const KvGeometry& b, absl::string_view a_is);

// In the FAILED_PRECONDITION of GetServerInfo from a server that restarted
// with another geometry than the one the client connected to.
inline constexpr absl::string_view kAnotherGeometry = "restarted with another geometry";
inline bool IsAnotherGeometry(const absl::Status& s) {
  return s.code() == absl::StatusCode::kFailedPrecondition && absl::StrContains(s.message(), kAnotherGeometry);
}

// A server's query dtype: q_dtype, or kv_dtype from a server that predates
// q_dtype (and has a 16-bit cache).
v1::DType QueryDType(const v1::ServerInfo& info);

// A lease GrantLease gave: its id and its time-to-live.
struct LeaseGrant {
  uint64_t id = 0;
  int64_t ttl_ms = 0;
};

// True for the error of a request that named a lease the server no longer
// holds (expired, revoked, or from before a restart): everything held under
// it was released. FAILED_PRECONDITION whose message starts "lease ".
bool IsLeaseExpired(const absl::Status& status);

// True for the error of a request that named the incarnation of a server
// that has since restarted (FAILED_PRECONDITION naming the incarnation):
// its pages, plans and leases are gone, and the request changed nothing.
bool IsStaleIncarnation(const absl::Status& status);

// True when a failed call may or may not have taken effect on the server:
// DEADLINE_EXCEEDED, UNAVAILABLE, CANCELLED, UNKNOWN, INTERNAL, ABORTED and
// DATA_LOSS (the reply, not the request, may be what was lost). Any other
// code is the server's definite answer: the request changed nothing.
bool OutcomeUnknown(const absl::Status& status);

// Whether Connect uses TLS: tls, or a CA or client certificate given (as the
// Python client decides).
inline bool UsesTls(const ClientOptions& o) { return o.tls || !o.tls_ca.empty() || !o.tls_cert.empty(); }

// The options Connect would refuse before connecting (INVALID_ARGUMENT
// naming the field and its bound): for command-line tools, which report
// them as flag errors.
absl::Status CheckClientOptions(const ClientOptions& options);

class Client {
 public:
  ~Client();

  // Connects and, unless options.fetch_info is false, reads the server's
  // geometry (GetServerInfo).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  const v1::ServerInfo& info() const { return info_; }
  // Per-call deadline from now on (0 or less: none; an infinite or huge one
  // is capped at about three years).
  void set_timeout_s(double seconds) { options_.timeout_s = seconds; }
  absl::StatusOr<v1::ServerInfo> GetServerInfo();
  absl::StatusOr<std::vector<int32_t>> AllocatePages(int32_t count);
  absl::Status FreePages(absl::Span<const int32_t> page_ids);
  // k, v: (n, num_kv_heads, head_dim) 16-bit rows of the server's q_dtype
  // (an FP8 server quantizes them with the layer's scales). An MLA server
  // (info().attention() == ATTENTION_MLA): k holds the latent rows (n, 1,
  // kv_lora_rank + qk_rope_head_dim) and v is empty (so are every call's V
  // inputs and regions below: an empty one is not sent to an MLA server).
  absl::Status WriteKV(int32_t layer, absl::Span<const int64_t> slots,
                       absl::Span<const uint16_t> k, absl::Span<const uint16_t> v);
  // An FP8 server: rows as its cache stores them (bytes of its kv_dtype).
  // To a 16-bit server they go as DTYPE_FP8_E4M3, which it refuses
  // (INVALID_ARGUMENT naming k.dtype).
  absl::Status WriteKVFp8(int32_t layer, absl::Span<const int64_t> slots,
                          absl::Span<const uint8_t> k, absl::Span<const uint8_t> v);
  // The rows as stored (an FP8 server's bytes in k_fp8 / v_fp8), or with
  // dequantize, an FP8 server's rows as q_dtype values (stored value x
  // scale) in k / v.
  absl::StatusOr<KvData> ReadKV(int32_t layer, absl::Span<const int64_t> slots,
                                bool dequantize = false);
  // An FP8 server's KV scales: sets the layers listed (all or none), or
  // reads every layer's (num_kv_heads entries each; empty from a 16-bit
  // server). docs/design.md, "FP8 KV cache".
  absl::Status SetKvScales(absl::Span<const LayerKvScales> layers);
  absl::StatusOr<std::vector<LayerKvScales>> GetKvScales();
  absl::StatusOr<PrefillResult> Prefill(const PrefillArgs& args);
  // Prefill into the caller's result, whose vectors' memory is reused: the
  // response's bytes are copied once, into memory already mapped when the
  // sizes repeat (an engine's steps), instead of into fresh vectors that
  // are zero-filled and page-faulted first (at 128 MiB that costs more than
  // the copy itself). Outputs written to regions leave o and lse empty.
  absl::Status PrefillInto(const PrefillArgs& args, PrefillResult* result);
  // Registers a step's layout once; every layer's Prefill then names the
  // returned plan id instead of sending the layout. ReleasePlan when done.
  absl::StatusOr<uint64_t> CreatePlan(const PlanLayout& layout);
  absl::Status ReleasePlan(uint64_t plan_id);
  // States each (n, h, d) with LSE (n, h).
  absl::StatusOr<State> MergeStates(absl::Span<const State> states, int64_t n, int32_t h,
                                    int32_t d, bool lse_base_e);
  // Shared-memory regions (docs/transport.md); the server must run with
  // --allow_shared_memory. A system region is [offset, offset + byte_size)
  // of `memory` (client/shared_memory.h), or of any memfd of the caller's
  // sealed with at least F_SEAL_SHRINK: the descriptor goes to the server's
  // region socket (ServerInfo.region_socket, so this process must run on
  // the server's host), then RegisterRegion names it. The client keeps the
  // region's holder connection until UnregisterRegion or its own end; the
  // memfd itself may be closed once this returns. A CUDA region is the
  // device memory a cudaIpcMemHandle_t (64 bytes) exports.
  absl::Status RegisterSystemRegion(const std::string& name, const SharedMemory& memory,
                                    int64_t offset, int64_t byte_size);
  absl::Status RegisterSystemRegionFd(const std::string& name, int memfd, int64_t offset,
                                      int64_t byte_size);
  absl::Status RegisterCudaRegion(const std::string& name, const std::string& ipc_handle,
                                  int32_t device_id, int64_t byte_size);
  // Also closes the region's holder connection, when this client has it.
  absl::Status UnregisterRegion(const std::string& name);
  absl::StatusOr<std::vector<v1::RegionInfo>> ListRegions();
  // WriteKV with k and v read from regions (n = slots.size() rows each).
  absl::Status WriteKVFromRegions(int32_t layer, absl::Span<const int64_t> slots,
                                  const RegionRef& k, const RegionRef& v);
  // ReadKV with the rows written to regions.
  absl::Status ReadKVToRegions(int32_t layer, absl::Span<const int64_t> slots,
                               const RegionRef& k, const RegionRef& v);

  // Opens a request channel (client/channel.h, docs/transport.md "Request
  // channels"): a ring of options.slot_count slots at [offset, offset +
  // byte_size) of system region `region_name`, which this process maps at
  // `region_data` (its byte 0, e.g. SharedMemory::data() when the region
  // starts at the object's start). Writes the ring's header there, then
  // calls OpenChannel. The channel must not outlive this client.
  absl::StatusOr<std::unique_ptr<RequestChannel>> OpenChannel(const std::string& region_name,
                                                              char* region_data, int64_t offset,
                                                              int64_t byte_size,
                                                              const ChannelOptions& options);

  // Leases. GrantLease(0) gives the server's default ttl. KeepAlive returns
  // the ttl the lease lives from now (timeout_s > 0: the call's own
  // deadline; `context`, when given, is the call's, which another thread may
  // cancel). RevokeLease ends it and returns what it released (nothing
  // when it was gone already). ListHoldings: everything this tenant holds
  // (lease_id 0) or one lease's. ReleaseHoldings: releases everything this
  // tenant holds, its leases included.
  absl::StatusOr<LeaseGrant> GrantLease(int64_t ttl_ms = 0);
  absl::StatusOr<int64_t> KeepAlive(uint64_t lease_id, double timeout_s = 0,
                                    grpc::ClientContext* context = nullptr);
  absl::StatusOr<v1::Holdings> RevokeLease(uint64_t lease_id);
  absl::StatusOr<v1::ListHoldingsResponse> ListHoldings(uint64_t lease_id = 0);
  absl::StatusOr<v1::Holdings> ReleaseHoldings();
  // The lease every later request names (0: none, as before any call).
  void UseLease(uint64_t lease_id) { lease_id_.store(lease_id, std::memory_order_relaxed); }
  uint64_t lease_id() const { return lease_id_.load(std::memory_order_relaxed); }
  // A client over the same connection and credentials, with this one's
  // server info and incarnation and no lease: for a component that holds
  // state under a lease of its own (the KV managers).
  std::unique_ptr<Client> Fork() const;

  // The server incarnation this client expects (0 before any answer).
  uint64_t incarnation() const { return incarnation_.load(std::memory_order_relaxed); }
  // Accept whatever incarnation answers next (after a restart, once the
  // caller has re-created its pages).
  // The next call that names pages, slots, plans, leases or regions first
  // reads the server's info (GetServerInfo), so that a server back with
  // another geometry is refused before anything is laid out for the old one.
  void ForgetIncarnation() {
    incarnation_.store(0, std::memory_order_relaxed);
    if (info_.num_layers() > 0) recheck_geometry_.store(true, std::memory_order_relaxed);
  }

  // Overall health ("" service) or one service; OK only when SERVING.
  absl::Status Health(const std::string& service = "");

  // For tests that send hand-made (also malformed) requests.
  v1::AttentionService::Stub* stub() { return stub_.get(); }
  void PrepareContext(grpc::ClientContext* ctx) const;

  // The status of a failed call. gRPC's own "Sent/Received message larger
  // than max" (this client's limit) names max_message_bytes and the ways
  // around it.
  static absl::Status FromGrpc(const grpc::Status& status);

 private:
  struct RawMethods;
  Client();

  // One unary call whose request and response are wire bytes (the
  // tensor-carrying RPCs, common/tensor_wire.h). The request is released
  // (and the call destroyed) when this returns, so that memory it borrowed
  // may be waited for then.
  grpc::Status CallRaw(const grpc::internal::RpcMethod& method, grpc::ByteBuffer request,
                       grpc::ByteBuffer* response);

  // Remembers `seen` when nothing was remembered yet.
  void Learn(uint64_t seen);
  // After ForgetIncarnation(): GetServerInfo() once, which refuses a server
  // back with another geometry; OK at once otherwise.
  absl::Status CheckGeometryAfterForget();
  // Sets the request's expected_incarnation, after that check: every request
  // that names pages, slots, plans, leases or regions goes through here.
  template <typename Request>
  absl::Status ExpectIncarnation(Request* req) {
    if (absl::Status g = CheckGeometryAfterForget(); !g.ok()) return g;
    req->set_expected_incarnation(incarnation());
    return absl::OkStatus();
  }

  // Whether a call's V input of v_size bytes (or a V region's name of that
  // length) goes on the wire: always to a GQA server; to an MLA server only
  // when not empty (which it refuses, naming the field).
  bool SendsV(size_t v_size) const {
    return info_.attention() != v1::ATTENTION_MLA || v_size > 0;
  }

  // WriteKV whose K and V (`dtype` on the wire) follow the request inline:
  // WriteKV and WriteKVFp8.
  absl::Status WriteKvInline(int32_t layer, absl::Span<const int64_t> slots, v1::DType dtype,
                             const void* k, size_t k_bytes, const void* v, size_t v_bytes);

  // A Prefill's wire bytes (its large inline tensors borrowed from the
  // caller's memory), and its response parsed into *result: shared by
  // Prefill and RequestChannel.
  grpc::ByteBuffer EncodePrefill(const PrefillArgs& args, BorrowedMemory* borrowed) const;
  absl::Status DecodePrefill(const grpc::ByteBuffer& bytes, PrefillResult* result);
  friend class RequestChannel;

  ClientOptions options_;
  std::atomic<uint64_t> incarnation_{0};
  std::atomic<bool> recheck_geometry_{false};  // ForgetIncarnation() since the last GetServerInfo()
  std::atomic<uint64_t> lease_id_{0};
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<RawMethods> raw_;
  v1::ServerInfo info_;
  // The holder connections of the system regions this client registered,
  // by region name.
  absl::Mutex holders_mu_;
  absl::flat_hash_map<std::string, UniqueFd> region_holders_ ABSL_GUARDED_BY(holders_mu_);
  // The rings (this process's addresses) of this client's open request
  // channels, and of one opening (channel_id 0): OpenChannel writes no ring
  // header over bytes one of them polls. A ring leaves at the channel's
  // first Close.
  struct OpenRing {
    const char* begin;
    const char* end;
    uint64_t channel_id;
  };
  absl::Mutex rings_mu_;
  std::vector<OpenRing> open_rings_ ABSL_GUARDED_BY(rings_mu_);
  void ForgetRing(const char* begin);
};

}  // namespace attnserve
