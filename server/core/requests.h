// Plain request structs handed from the gRPC edge to the core.
//
// The edge converts protos into these views without copying tensor bytes:
// every span and string_view points into the request message or, for the
// inline tensors of Prefill and WriteKV, into the slices gRPC received it in,
// which the edge keeps alive until the done callback has run. Prefill's outputs go to a
// HostBuffer the core gets from the backend and the edge sends from; the
// other calls' outputs are std::strings owned by the response message, which
// the core sizes and fills.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/kv_geometry.h"
#include "server/backend/host_buffer.h"
#include "common/scatter_list.h"
#include "server/core/region_table.h"

namespace attnserve {

// Element type of a tensor as its caller declared it: one of common's
// KvDType, float32 (LSE), or one no field takes (unspecified, or not an
// attnserve.v1.DType at all). The edge maps attnserve.v1.DType onto it in
// one place (server/grpc/convert.h); validation compares it with what each
// field needs.
enum class TensorDType : int32_t {
  kUnspecified,
  kBf16,
  kFp16,
  kFp32,
  kFp8E4m3,
  kFp8E5m2,
  kUnknown
};

// The tensor dtype of a 16-bit element type.
inline TensorDType TensorDTypeOf(KvDType dtype) {
  return dtype == KvDType::kBf16 ? TensorDType::kBf16 : TensorDType::kFp16;
}

// The tensor dtype of an FP8 format (kUnknown for kNone).
inline TensorDType TensorDTypeOf(Fp8Format format) {
  return format == Fp8Format::kE4m3   ? TensorDType::kFp8E4m3
         : format == Fp8Format::kE5m2 ? TensorDType::kFp8E5m2
                                      : TensorDType::kUnknown;
}

// Bytes of one element (0 for kUnspecified and kUnknown).
inline int64_t TensorDTypeBytes(TensorDType dtype) {
  switch (dtype) {
    case TensorDType::kBf16:
    case TensorDType::kFp16: return 2;
    case TensorDType::kFp32: return 4;
    case TensorDType::kFp8E4m3:
    case TensorDType::kFp8E5m2: return 1;
    case TensorDType::kUnspecified:
    case TensorDType::kUnknown: break;
  }
  return 0;
}

// Its name in error messages: the API's ("DTYPE_BF16", ...) or "unknown".
inline const char* TensorDTypeName(TensorDType dtype) {
  switch (dtype) {
    case TensorDType::kUnspecified: return "DTYPE_UNSPECIFIED";
    case TensorDType::kBf16: return "DTYPE_BF16";
    case TensorDType::kFp16: return "DTYPE_FP16";
    case TensorDType::kFp32: return "DTYPE_FP32";
    case TensorDType::kFp8E4m3: return "DTYPE_FP8_E4M3";
    case TensorDType::kFp8E5m2: return "DTYPE_FP8_E5M2";
    case TensorDType::kUnknown: break;
  }
  return "unknown";
}

// A request tensor. Its bytes are `data`, or `scattered` (an inline tensor
// that arrived in several of gRPC's slices: data is then empty), or, when
// region.set, a range of a shared-memory region that the core resolves (and
// then points data at). Inline bytes point into what gRPC received and are
// not aligned to anything. on_device: data is device memory (a CUDA region)
// that host code must never read; only the backend copies it. pinned: data
// is page-locked host memory (a system region registered with the device)
// that the device may copy directly.
struct TensorView {
  TensorDType dtype = TensorDType::kUnspecified;
  std::vector<int64_t> shape;
  absl::string_view data;
  ScatterList scattered;
  RegionRefView region;
  bool on_device = false;
  bool pinned = false;

  // The tensor's bytes, wherever they are.
  int64_t byte_size() const {
    return scattered.empty() ? static_cast<int64_t>(data.size()) : scattered.size;
  }
};

// Called once when a queued request is finished (from the scheduler thread),
// or at once when validation rejects it.
using DoneCallback = std::function<void(absl::Status)>;

// What every call carries besides its fields: the caller's tenant, its
// deadline (the request is dropped before launch once it passes), an
// optional cancellation probe, the edge's request id (AttentionCore::Cancel
// names it), the incarnation the caller expects (docs/design.md section
// 4: a stale one fails with FAILED_PRECONDITION and changes nothing) and the
// lease it names (lease_table.h: what the call makes is held under it, and
// what it uses must be).
struct CallContext {
  std::string tenant;
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> is_cancelled;
  uint64_t request_id = 0;
  uint64_t expected_incarnation = 0;  // 0: not checked
  uint64_t lease_id = 0;              // 0: none
  // Bytes of server memory the request's message holds until it is
  // answered (its inline tensors included); with its response's, the job's
  // Job::held_bytes (SchedulerOptions::max_queue_bytes). Set by the edge.
  int64_t message_bytes = 0;
  // Where the caller keeps its response after the answer (the gRPC edge,
  // until gRPC has sent it): the response's bytes stay held until the
  // caller runs the release (Job::hold_response). Empty: they are free with
  // the answer (a request channel copies its response into the ring there).
  std::function<void(std::function<void()> release)> hold_response;
};

// Prefill's outputs, filled by the core with their shapes: o (total_q,
// num_qo_heads, v_head_dim) in dtype at offset 0, then lse (total_q,
// num_qo_heads) float32 at lse_offset, both in `buffer` (empty when total_q
// is 0). The edge encodes the response from this alone.
struct PrefillOutput {
  bool in_region = false;  // written to the call's out_region / lse_region; no buffer
  HostBuffer buffer;
  KvDType dtype = KvDType::kBf16;
  int64_t total_q = 0;
  // The largest sequence's query rows, the request's layout or its plan's,
  // once validated (-1 before): the metrics' shape of a planned Prefill.
  int64_t max_seq_q_rows = -1;
  int32_t num_qo_heads = 0;
  int32_t v_head_dim = 0;  // the geometry's VDim(): head_dim, or MLA's kv_lora_rank
  int64_t o_bytes = 0;
  int64_t lse_offset = 0;
  int64_t lse_bytes = 0;
};

// Attention options (docs/design.md, "Variants") as a request carries them;
// an unset field is not specified (the plan's for the layer, else the
// default, applies).
struct AttentionOptionsView {
  std::optional<int32_t> window_left;      // -1: no window
  std::optional<float> logits_soft_cap;    // 0: none
  absl::Span<const float> sinks;           // (num_qo_heads) natural units, or empty: none set
};

// A CreatePlan's options: those of every layer, and per layer those that
// replace them whole for that layer.
struct PlanOptionsView {
  AttentionOptionsView all;
  std::vector<std::pair<int32_t, AttentionOptionsView>> layers;
};

struct PrefillCall : CallContext {
  int32_t layer = 0;
  TensorView q;                               // (total_q, num_qo_heads, head_dim)
  absl::Span<const int32_t> qo_indptr;        // (batch + 1)
  absl::Span<const int32_t> kv_indptr;        // (batch + 1)
  absl::Span<const int32_t> kv_indices;       // (kv_indptr[batch])
  absl::Span<const int32_t> kv_last_page_len; // (batch), may be empty at page_size 1
  std::optional<float> sm_scale;              // default 1/sqrt(head_dim)
  std::optional<bool> causal;                 // default true
  int32_t lse_base = 0;                       // 0: base 2, 1: base e
  absl::Span<const int64_t> append_slots;     // (n)
  TensorView append_k;                        // (n, num_kv_heads, head_dim)
  TensorView append_v;
  absl::Span<const int32_t> kv_keys_after;    // (batch) or empty: PrefillSeq::causal_shift
  absl::Span<const bool> apply_sinks;         // (batch) or empty: where options.sinks enter
  AttentionOptionsView options;               // window, soft-cap, sinks
  uint64_t plan_id = 0;                       // 0: the layout fields above hold the layout
  // Both set: o and lse are written there, and `out` gets no buffer.
  RegionRefView out_region;                   // (total_q, num_qo_heads, head_dim) bytes
  RegionRefView lse_region;                   // (total_q, num_qo_heads) float32 bytes
  PrefillOutput* out = nullptr;               // filled by the core
};

struct WriteKvCall : CallContext {
  int32_t layer = 0;
  absl::Span<const int64_t> slots;  // (n)
  TensorView k;                     // (n, num_kv_heads, head_dim)
  TensorView v;
};

struct ReadKvCall : CallContext {
  int32_t layer = 0;
  absl::Span<const int64_t> slots;  // (n)
  // FP8 caches: the rows in the query dtype (stored values times their
  // scales) instead of the stored FP8 bytes; no effect on a 16-bit cache.
  bool dequantize = false;
  // Set by the core once validated: the dtype of the rows it writes.
  TensorDType* out_dtype = nullptr;
  std::string* out_k = nullptr;     // (n, num_kv_heads, head_dim), sized by the core
  std::string* out_v = nullptr;
  // Both set: the rows are written there and out_k / out_v stay empty.
  RegionRefView k_region;
  RegionRefView v_region;
};

struct MergeStatesCall : CallContext {
  std::vector<TensorView> v;    // each (n, h, d)
  std::vector<TensorView> lse;  // each (n, h), float32
  int32_t lse_base = 0;
  std::string* out_v = nullptr;    // (n, h, d), sized by the core
  std::string* out_lse = nullptr;  // (n, h)
  // Both set: the merged state is written there and out_v / out_lse stay empty.
  RegionRefView v_region;
  RegionRefView lse_region;
};

// One layer's KV scales (SetKvScales, GetKvScales): 1 entry (the whole
// layer) or num_kv_heads entries each; real = fp8 value x scale.
struct LayerScalesView {
  int32_t layer = 0;
  absl::Span<const float> k_scale;
  absl::Span<const float> v_scale;
};

struct SetKvScalesCall : CallContext {
  std::vector<LayerScalesView> layers;
};

// Every layer's scales, num_kv_heads entries each (empty on a 16-bit cache).
struct LayerScales {
  int32_t layer = 0;
  std::vector<float> k_scale;
  std::vector<float> v_scale;
};

// Snapshot for GetServerInfo.
struct ServerInfoData {
  std::string version;
  std::string backend;
  std::string device;
  int32_t num_layers = 0;
  int32_t num_pages = 0;
  int32_t page_size = 0;
  int32_t num_qo_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  AttentionKind attention = AttentionKind::kGqa;
  int32_t v_head_dim = 0;        // head_dim, or MLA's kv_lora_rank
  int32_t kv_lora_rank = 0;      // MLA only
  int32_t qk_rope_head_dim = 0;  // MLA only
  KvDType kv_dtype = KvDType::kBf16;  // queries and outputs (q_dtype); the KV too unless kv_fp8
  Fp8Format kv_fp8 = Fp8Format::kNone;
  int64_t kv_cache_bytes = 0;  // K and V of every layer and page
  int64_t page_bytes = 0;      // K and V of one page in every layer
  int32_t free_pages = 0;
  int32_t max_batch_tokens = 0;
  int64_t max_message_bytes = 0;
  uint64_t incarnation = 0;
  int64_t lease_default_ttl_ms = 0;
  int64_t lease_max_ttl_ms = 0;
  // Sequences of at least this many query rows run with their queries
  // rounded to E4M3 (Backend::Fp8QueryMinRows); 0: none.
  int32_t fp8_query_min_rows = 0;
};

// What a tenant holds, or holds under one lease (ListHoldings, and what
// RevokeLease and ReleaseHoldings released). Each list ascending.
struct HoldingsData {
  std::vector<int32_t> pages;
  std::vector<uint64_t> plans;
  std::vector<std::string> regions;
  std::vector<uint64_t> channels;
};

struct LeaseData {
  uint64_t id = 0;
  int64_t ttl_ms = 0;
  int64_t remaining_ms = 0;
  HoldingsData holdings;
};

struct ListHoldingsData {
  std::vector<LeaseData> leases;
  HoldingsData unleased;
};

}  // namespace attnserve
