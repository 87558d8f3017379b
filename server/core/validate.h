// Validation of every request field before anything is queued
// (docs/design.md section 4). Pure functions: no page table, no device. Errors
// name the field and the bound; the code is INVALID_ARGUMENT for malformed
// input, RESOURCE_EXHAUSTED for sizes over a limit and FAILED_PRECONDITION
// for a stale expected_incarnation.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/kv_geometry.h"
#include "server/backend/backend.h"
#include "server/core/requests.h"

namespace attnserve {

struct RequestLimits {
  int64_t max_message_bytes = 512ll << 20;  // bounds each response
  int32_t max_request_rows = 0;             // query or KV rows in one request
  int64_t max_request_kv_indices = 0;       // page indices in one request
};

// A Prefill that passed validation: the backend task (output pointers still
// unset) and the pages it touches, to be pinned.
struct ValidatedPrefill {
  PrefillTask task;
  std::vector<int32_t> pages;  // one entry per reference (repeats allowed)
  int64_t out_bytes = 0;       // bytes of o
  int64_t lse_bytes = 0;       // bytes of lse
};

// A batch's layout (FlashInfer's): the fields a Prefill and a CreatePlan share.
struct PrefillLayout {
  absl::Span<const int32_t> qo_indptr;         // (batch + 1)
  absl::Span<const int32_t> kv_indptr;         // (batch + 1)
  absl::Span<const int32_t> kv_indices;        // (kv_indptr[batch])
  absl::Span<const int32_t> kv_last_page_len;  // (batch), may be empty at page_size 1
  absl::Span<const int64_t> append_slots;      // (n)
  // (batch) or empty: keys of each sequence held after this range
  // (PrefillSeq::causal_shift); empty means 0 for every sequence.
  absl::Span<const int32_t> kv_keys_after;
  // (batch) or empty (all true): the sequences a request's sinks enter.
  absl::Span<const bool> apply_sinks = {};
};

// Attention options (docs/design.md, "Variants") that passed validation,
// owned (a plan keeps them); unset fields as in AttentionOptionsView.
struct AttentionOptionsData {
  std::optional<int32_t> window_left;
  std::optional<float> logits_soft_cap;
  std::vector<float> sinks;  // (num_qo_heads) or empty
};

// A plan's options: every layer's, and those replacing them for some layers.
struct PlanOptions {
  AttentionOptionsData all;
  absl::flat_hash_map<int32_t, AttentionOptionsData> layers;
  // The options of `layer`: its entry, else `all`.
  const AttentionOptionsData& For(int32_t layer) const {
    auto it = layers.find(layer);
    return it == layers.end() ? all : it->second;
  }
};

// A layout that passed validation: the sequences (q_start, q_len, kv_start,
// kv_len, causal_shift set; sink_index 0 where apply_sinks lets sinks in,
// -1 where not; the per-request fields not) and the pages it touches.
struct ValidatedLayout {
  int64_t total_q = 0;
  std::vector<PrefillSeq> seqs;
  // Where sequences without query rows were left out (keep_empty false):
  // the request's index of each of seqs (PrefillTask::seq_numbers); empty
  // when none was.
  std::vector<int32_t> seq_numbers;
  std::vector<int32_t> pages;  // kv_indices, then the append slots' pages (repeats allowed)
  int64_t num_append = 0;
};

// Checks a layout whose qo_indptr must end at total_q (named total_name in
// errors): indptrs, page ids in range, last-page lengths, kv_keys_after,
// append slots in range and distinct. keep_empty false: sequences without
// query rows are validated (and their pages listed) but not kept in seqs.
absl::StatusOr<ValidatedLayout> ValidateLayout(const PrefillLayout& layout, int64_t total_q,
                                               absl::string_view total_name,
                                               const KvGeometry& geo,
                                               const RequestLimits& limits,
                                               bool keep_empty = true);
// A CreatePlan's layout: as ValidateLayout, total_q taken from qo_indptr.
absl::StatusOr<ValidatedLayout> ValidatePlanLayout(const PrefillLayout& layout,
                                                   const KvGeometry& geo,
                                                   const RequestLimits& limits);

// The bounds of AttentionOptions (proto/attnserve/v1/attention.proto): a
// window of at least -1, a soft-cap of 0 or in [kMinSoftCap, kMaxSoftCap],
// num_qo_heads sinks each -inf or finite of magnitude at most
// kMaxSinkMagnitude. `field` names the message in errors ("options",
// "layer_options[3]").
inline constexpr float kMaxSinkMagnitude = 1e30f;
// A soft-cap's range (models use 20-50): c * log2(e) stays a finite, normal
// float (the GPU kernels flush subnormals to 0, which would turn the cap off).
inline constexpr float kMinSoftCap = 1e-30f;
inline constexpr float kMaxSoftCap = 1e30f;
// The largest |sm_scale| a Prefill may ask for: a model's scale is near
// 1/sqrt(head_dim); a larger one would only push ordinary logits past
// float32's range.
inline constexpr float kMaxSmScaleMagnitude = 1e30f;
absl::Status ValidateOptions(const AttentionOptionsView& options, absl::string_view field,
                             const KvGeometry& geo);
// A CreatePlan's options: each valid, layer keys in [0, num_layers); copied.
absl::StatusOr<PlanOptions> ValidatePlanOptions(const PlanOptionsView& options,
                                                const KvGeometry& geo);

// FAILED_PRECONDITION when a caller expects another incarnation than the
// server's (0: not checked): it outlived a restart.
absl::Status CheckIncarnation(uint64_t expected, uint64_t incarnation);

absl::StatusOr<ValidatedPrefill> ValidatePrefill(const PrefillCall& call,
                                                 const KvGeometry& geo,
                                                 const RequestLimits& limits,
                                                 uint64_t incarnation);

// A Prefill naming a plan (call.plan_id): its layout fields must be empty,
// q must have the plan's rows and the append tensors its append rows, and
// the options it sets must agree with plan_options.For(call.layer), which
// supply the ones it leaves unset. The task reads kv_indices, append_slots
// and any sinks from the plan's arrays; no pages are returned (the plan
// holds their pins).
absl::StatusOr<ValidatedPrefill> ValidatePlannedPrefill(const PrefillCall& call,
                                                        const ValidatedLayout& plan,
                                                        const int32_t* kv_indices,
                                                        const int64_t* append_slots,
                                                        const PlanOptions& plan_options,
                                                        const KvGeometry& geo,
                                                        const RequestLimits& limits,
                                                        uint64_t incarnation);

// WriteKV / ReadKV: layer and slots; for WriteKV also k and v (pass nullptr
// for ReadKV; on an MLA server v must be unset: k holds the latent rows). Returns the page of each slot (repeats allowed). rows_fp8
// (may be null): a WriteKV's k and v are FP8 rows as stored (set here, from
// their dtype); for a ReadKV, whether the rows read are the stored FP8
// bytes (given: it sizes the response).
absl::StatusOr<std::vector<int32_t>> ValidateKvRows(int32_t layer,
                                                    absl::Span<const int64_t> slots,
                                                    const TensorView* k, const TensorView* v,
                                                    const KvGeometry& geo,
                                                    const RequestLimits& limits,
                                                    bool* rows_fp8 = nullptr);

// The dtype of K and V rows a write carries (WriteKV's k and v, a Prefill's
// append_k and append_v; named k_field and v_field in errors): the query
// dtype, or on an FP8 cache its FP8 format (true: stored as they are). FP8
// rows to a 16-bit cache, another FP8 format, and k and v of different
// dtypes are INVALID_ARGUMENT naming the field. The shapes are checked
// apart (ValidateTensor).
absl::StatusOr<bool> KvRowsAreFp8(const TensorView& k, const TensorView& v,
                                  absl::string_view k_field, absl::string_view v_field,
                                  const KvGeometry& geo);

// SetKvScales: an FP8 cache; layers in [0, num_layers), each at most once;
// k_scale and v_scale of 1 or num_kv_heads entries, each finite and in (0,
// kMaxKScale] or (0, kMaxVScale]. INVALID_ARGUMENT naming the field and the
// bound. V's bound keeps every FP8 value times its scale finite in float32;
// K's keeps the logit multiplier |sm_scale| x k_scale x log2(e) finite
// (|sm_scale| <= kMaxSmScaleMagnitude: 1e30 x 1e8 x 1.44 < 3.4e38), so that
// no kernel clamps it (LogitTransform::Of, kernels/variant.h).
inline constexpr float kMaxKScale = 1e8f;
inline constexpr float kMaxVScale = 1e30f;
absl::Status ValidateKvScales(absl::Span<const LayerScalesView> layers, const KvGeometry& geo);

// States one MergeStates request may merge.
inline constexpr int64_t kMaxMergeStates = 256;

// MergeStates: at most kMaxMergeStates states, every one the same (n, h, d),
// v in kv dtype, lse float32.
struct MergeShape {
  int64_t n = 0;
  int32_t h = 0;
  int32_t d = 0;
};
absl::StatusOr<MergeShape> ValidateMerge(const MergeStatesCall& call, const KvGeometry& geo,
                                         const RequestLimits& limits);

// Checks a tensor's dtype, shape and byte size. `field` names it in errors.
absl::Status ValidateTensor(const TensorView& t, absl::string_view field, TensorDType dtype,
                            absl::Span<const int64_t> shape);

}  // namespace attnserve
