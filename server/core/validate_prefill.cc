// Validation of Prefill calls and their layouts, plans and options (the
// rest of a request's checks: validate.cc).
#include "server/core/validate.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/core/status_macros.h"
#include "server/core/validate_internal.h"

namespace attnserve {

using validate_detail::CheckLayer;
using validate_detail::CheckResponseSize;
using validate_detail::CheckSlots;
using validate_detail::TensorUnset;
using validate_detail::CheckVPresence;

namespace {

// Checks an indptr array: size batch + 1, starts at 0, non-decreasing, ends at `total`.
absl::Status CheckIndptr(absl::Span<const int32_t> indptr, absl::string_view field,
                         int64_t total, absl::string_view total_name) {
  if (indptr.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty: needs batch + 1 >= 1 entries"));
  }
  if (indptr[0] != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, "[0]=", indptr[0], " must be 0"));
  }
  for (size_t i = 1; i < indptr.size(); ++i) {
    if (indptr[i] < indptr[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]=", indptr[i],
                                                     " is less than ", field, "[", i - 1,
                                                     "]=", indptr[i - 1],
                                                     ": must be non-decreasing"));
    }
  }
  if (indptr.back() != total) {
    return absl::InvalidArgumentError(absl::StrCat(field, "[", indptr.size() - 1, "]=",
                                                   indptr.back(), " must equal ", total_name,
                                                   "=", total));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateOptions(const AttentionOptionsView& o, absl::string_view field,
                             const KvGeometry& geo) {
  if (o.window_left.has_value() && *o.window_left < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".window_left=", *o.window_left, " out of range [-1, ", INT32_MAX,
                     "] (-1: no window)"));
  }
  if (o.logits_soft_cap.has_value() &&
      !(*o.logits_soft_cap == 0.f ||
        (*o.logits_soft_cap >= kMinSoftCap && *o.logits_soft_cap <= kMaxSoftCap))) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".logits_soft_cap=", *o.logits_soft_cap, " must be 0 (no soft-cap) or in [",
                     kMinSoftCap, ", ", kMaxSoftCap, "]"));
  }
  if (!o.sinks.empty() && static_cast<int64_t>(o.sinks.size()) != geo.num_qo_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".sinks has ", o.sinks.size(), " entries, must have num_qo_heads = ",
                     geo.num_qo_heads, " (or none)"));
  }
  for (size_t h = 0; h < o.sinks.size(); ++h) {
    const float x = o.sinks[h];
    if (x == -std::numeric_limits<float>::infinity()) continue;  // no sink for this head
    if (!(std::abs(x) <= kMaxSinkMagnitude)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".sinks[", h, "]=", x, " must be -inf (none) or finite in [-",
          kMaxSinkMagnitude, ", ", kMaxSinkMagnitude, "]"));
    }
  }
  return absl::OkStatus();
}

namespace {

AttentionOptionsData Own(const AttentionOptionsView& o) {
  AttentionOptionsData d;
  d.window_left = o.window_left;
  d.logits_soft_cap = o.logits_soft_cap;
  d.sinks.assign(o.sinks.begin(), o.sinks.end());
  return d;
}

}  // namespace

absl::StatusOr<PlanOptions> ValidatePlanOptions(const PlanOptionsView& options,
                                                const KvGeometry& geo) {
  ATTN_RETURN_IF_ERROR(ValidateOptions(options.all, "options", geo));
  PlanOptions out;
  out.all = Own(options.all);
  for (const auto& [layer, o] : options.layers) {
    if (layer < 0 || layer >= geo.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer_options has key ", layer, " out of range [0, ", geo.num_layers, ") (num_layers)"));
    }
    ATTN_RETURN_IF_ERROR(ValidateOptions(o, absl::StrCat("layer_options[", layer, "]"), geo));
    out.layers[layer] = Own(o);
  }
  return out;
}

absl::Status CheckIncarnation(uint64_t expected, uint64_t incarnation) {
  if (expected != 0 && expected != incarnation) {
    return absl::FailedPreconditionError(
        absl::StrCat("expected_incarnation=", expected, " differs from the server's incarnation ",
                     incarnation, ": the server restarted, its KV cache is gone and its pages "
                     "may belong to others now; allocate and write again"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ValidatedLayout> ValidateLayout(const PrefillLayout& layout, int64_t total_q,
                                               absl::string_view total_name,
                                               const KvGeometry& geo,
                                               const RequestLimits& limits,
                                               bool keep_empty) {
  // Sequences are bounded like rows, before anything is sized by their count.
  if (static_cast<int64_t>(layout.qo_indptr.size()) > int64_t{limits.max_request_rows} + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "qo_indptr has ", layout.qo_indptr.size(), " entries: at most ",
        int64_t{limits.max_request_rows} + 1, " (a request holds at most max_request_rows=",
        limits.max_request_rows, " sequences)"));
  }
  ATTN_RETURN_IF_ERROR(CheckIndptr(layout.qo_indptr, "qo_indptr", total_q, total_name));
  const int64_t batch = static_cast<int64_t>(layout.qo_indptr.size()) - 1;
  if (static_cast<int64_t>(layout.kv_indptr.size()) != batch + 1) {
    return absl::InvalidArgumentError(absl::StrCat("kv_indptr has ", layout.kv_indptr.size(),
                                                   " entries, must have batch + 1 = ", batch + 1,
                                                   " (as qo_indptr)"));
  }
  if (static_cast<int64_t>(layout.kv_indices.size()) > limits.max_request_kv_indices) {
    return absl::InvalidArgumentError(absl::StrCat("kv_indices has ", layout.kv_indices.size(),
                                                   " entries, at most ",
                                                   limits.max_request_kv_indices));
  }
  ATTN_RETURN_IF_ERROR(CheckIndptr(layout.kv_indptr, "kv_indptr",
                                   static_cast<int64_t>(layout.kv_indices.size()),
                                   "len(kv_indices)"));
  const bool has_last = !layout.kv_last_page_len.empty();
  if (has_last && static_cast<int64_t>(layout.kv_last_page_len.size()) != batch) {
    return absl::InvalidArgumentError(absl::StrCat("kv_last_page_len has ",
                                                   layout.kv_last_page_len.size(),
                                                   " entries, must have batch = ", batch));
  }
  if (!has_last && geo.page_size != 1 && layout.kv_indices.size() > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_last_page_len is missing: it may be omitted only when page_size is 1 (page_size=",
        geo.page_size, ")"));
  }
  ValidatedLayout out;
  out.total_q = total_q;
  out.pages.assign(layout.kv_indices.begin(), layout.kv_indices.end());
  for (size_t i = 0; i < out.pages.size(); ++i) {
    if (out.pages[i] < 0 || out.pages[i] >= geo.num_pages) {
      return absl::InvalidArgumentError(absl::StrCat("kv_indices[", i, "]=", out.pages[i],
                                                     " out of range [0, ", geo.num_pages, ")"));
    }
  }
  const bool has_after = !layout.kv_keys_after.empty();
  if (has_after && static_cast<int64_t>(layout.kv_keys_after.size()) != batch) {
    return absl::InvalidArgumentError(absl::StrCat("kv_keys_after has ",
                                                   layout.kv_keys_after.size(),
                                                   " entries, must have batch = ", batch,
                                                   " (or none)"));
  }
  const bool has_apply = !layout.apply_sinks.empty();
  if (has_apply && static_cast<int64_t>(layout.apply_sinks.size()) != batch) {
    return absl::InvalidArgumentError(absl::StrCat("apply_sinks has ",
                                                   layout.apply_sinks.size(),
                                                   " entries, must have batch = ", batch,
                                                   " (or none)"));
  }
  // Sequences without query rows read nothing; where they are not kept, a
  // request of many of them (2 bytes each on the wire) holds no memory for
  // them while it waits.
  out.seqs.reserve(keep_empty ? batch : std::min(batch, total_q));
  bool dropped = false;
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t num_pages = layout.kv_indptr[b + 1] - layout.kv_indptr[b];
    int32_t last =
        geo.page_size == 1 && !has_last ? 1 : (has_last ? layout.kv_last_page_len[b] : 0);
    if (num_pages > 0 && (last < 1 || last > geo.page_size)) {
      return absl::InvalidArgumentError(absl::StrCat("kv_last_page_len[", b, "]=", last,
                                                     " out of range [1, ", geo.page_size,
                                                     "] (page_size)"));
    }
    if (num_pages == 0 && (last < 0 || last > geo.page_size)) {
      return absl::InvalidArgumentError(absl::StrCat("kv_last_page_len[", b, "]=", last,
                                                     " out of range [0, ", geo.page_size,
                                                     "] (sequence ", b, " has no pages)"));
    }
    PrefillSeq seq;
    seq.q_start = layout.qo_indptr[b];
    seq.q_len = layout.qo_indptr[b + 1] - layout.qo_indptr[b];
    seq.kv_start = layout.kv_indptr[b];
    const int64_t kv_len =
        num_pages == 0 ? 0 : int64_t{num_pages - 1} * geo.page_size + last;
    if (kv_len > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", b, " has ", kv_len,
                                                     " KV tokens, at most ", INT32_MAX));
    }
    // A sequence's keys are distinct rows of one layer, so no sequence has
    // more than a layer's slots; past them its pages repeat, and each
    // repeat would multiply the request's work (docs/security.md).
    if (kv_len > geo.SlotsPerLayer()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", b, " has ", kv_len, " KV tokens (", num_pages,
          " kv_indices), more than the cache's num_pages x page_size = ", geo.SlotsPerLayer(),
          " rows a layer: its kv_indices must repeat a page"));
    }
    seq.kv_len = static_cast<int32_t>(kv_len);
    if (has_after) {
      // The whole sequence's length, kv_len + kv_keys_after, must fit int32.
      const int64_t after = layout.kv_keys_after[b];
      const int64_t max_after = int64_t{INT32_MAX} - kv_len;
      if (after < 0 || after > max_after) {
        return absl::InvalidArgumentError(absl::StrCat(
            "kv_keys_after[", b, "]=", after, " out of range [0, ", max_after,
            "] (2^31 - 1 - kv_len=", kv_len, " of sequence ", b, ")"));
      }
      seq.causal_shift = static_cast<int32_t>(after);
    }
    // The request's one sink set, where it may enter (ValidateAgainstLayout
    // takes it out again when there are no sinks).
    seq.sink_index = !has_apply || layout.apply_sinks[b] ? 0 : -1;
    if (!keep_empty && seq.q_len == 0) {
      if (!dropped) {
        for (size_t k = 0; k < out.seqs.size(); ++k) out.seq_numbers.push_back(static_cast<int32_t>(k));
        dropped = true;
      }
      continue;
    }
    if (dropped) out.seq_numbers.push_back(static_cast<int32_t>(b));
    out.seqs.push_back(seq);
  }
  out.num_append = static_cast<int64_t>(layout.append_slots.size());
  if (out.num_append > limits.max_request_rows) {
    return absl::InvalidArgumentError(absl::StrCat("append_slots has ", out.num_append,
                                                   " entries, at most ",
                                                   limits.max_request_rows));
  }
  if (out.num_append > 0) {
    ATTN_ASSIGN_OR_RETURN(std::vector<int32_t> append_pages,
                          CheckSlots(layout.append_slots, "append_slots", geo));
    out.pages.insert(out.pages.end(), append_pages.begin(), append_pages.end());
  }
  // Not sorted or deduplicated: a pin is a count, so a page listed twice is
  // pinned and unpinned twice, and sorting 16k shuffled ids cost ~1 ms.
  return out;
}

absl::StatusOr<ValidatedLayout> ValidatePlanLayout(const PrefillLayout& layout,
                                                   const KvGeometry& geo,
                                                   const RequestLimits& limits) {
  if (layout.qo_indptr.empty()) {
    return absl::InvalidArgumentError("qo_indptr is empty: needs batch + 1 >= 1 entries");
  }
  const int64_t total_q = layout.qo_indptr.back();
  if (total_q < 0 || total_q > limits.max_request_rows) {
    return absl::InvalidArgumentError(absl::StrCat("qo_indptr[", layout.qo_indptr.size() - 1,
                                                   "]=", total_q, " out of range [0, ",
                                                   limits.max_request_rows,
                                                   "] (max_request_rows)"));
  }
  return ValidateLayout(layout, total_q, "the last entry", geo, limits);
}

namespace {

// The one value of an option the request and its plan may both set: the
// request's when set (it must then equal the plan's, if that is set too).
template <typename T>
absl::StatusOr<std::optional<T>> Agree(const std::optional<T>& mine, const std::optional<T>& plan,
                                       absl::string_view name, int32_t layer) {
  if (!mine.has_value()) return plan;
  if (plan.has_value() && !(*plan == *mine)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.", name, "=", *mine, " contradicts the plan's ", name, "=", *plan,
        " for layer ", layer, " (leave it unset to take the plan's)"));
  }
  return mine;
}

// The options a Prefill runs with: its own, and for what it leaves unset its
// plan's for its layer (`plan` null: no plan). The sinks point into the
// request or the plan.
struct ResolvedOptions {
  int32_t window_left = -1;
  float soft_cap = 0.f;
  const float* sinks = nullptr;
};

absl::StatusOr<ResolvedOptions> ResolveOptions(const PrefillCall& call,
                                               const AttentionOptionsData* plan,
                                               const KvGeometry& geo) {
  const AttentionOptionsView& mine = call.options;
  ATTN_RETURN_IF_ERROR(ValidateOptions(mine, "options", geo));
  const AttentionOptionsData theirs_none;
  const AttentionOptionsData& theirs = plan != nullptr ? *plan : theirs_none;
  ResolvedOptions r;
  ATTN_ASSIGN_OR_RETURN(std::optional<int32_t> window,
                        Agree(mine.window_left, theirs.window_left, "window_left", call.layer));
  ATTN_ASSIGN_OR_RETURN(
      std::optional<float> cap,
      Agree(mine.logits_soft_cap, theirs.logits_soft_cap, "logits_soft_cap", call.layer));
  r.window_left = window.value_or(-1);
  r.soft_cap = cap.value_or(0.f);
  if (!mine.sinks.empty() && !theirs.sinks.empty()) {
    for (size_t h = 0; h < mine.sinks.size(); ++h) {
      if (!(mine.sinks[h] == theirs.sinks[h])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "options.sinks[", h, "]=", mine.sinks[h], " contradicts the plan's sinks[", h,
            "]=", theirs.sinks[h], " for layer ", call.layer,
            " (leave options.sinks empty to take the plan's)"));
      }
    }
  }
  if (!mine.sinks.empty()) {
    r.sinks = mine.sinks.data();
  } else if (!theirs.sinks.empty()) {
    r.sinks = theirs.sinks.data();
  }
  return r;
}

// What a Prefill carries besides its layout: layer, q with the layout's rows,
// scale, mask, options, LSE base, and the append rows the layout's slots
// receive. plan_options: the options its plan gives its layer (null: none).
absl::StatusOr<ValidatedPrefill> ValidateAgainstLayout(const PrefillCall& call,
                                                       const ValidatedLayout& layout,
                                                       const AttentionOptionsData* plan_options,
                                                       const KvGeometry& geo,
                                                       const RequestLimits& limits) {
  ATTN_ASSIGN_OR_RETURN(const ResolvedOptions options,
                        ResolveOptions(call, plan_options, geo));
  float sm_scale = 1.0f / std::sqrt(static_cast<float>(geo.head_dim));
  if (call.sm_scale.has_value()) {
    if (!std::isfinite(*call.sm_scale) || std::fabs(*call.sm_scale) > kMaxSmScaleMagnitude) {
      return absl::InvalidArgumentError(absl::StrCat("sm_scale=", *call.sm_scale,
                                                     " must be finite with |sm_scale| <= ",
                                                     kMaxSmScaleMagnitude));
    }
    sm_scale = *call.sm_scale;
  }
  if (call.lse_base != 0 && call.lse_base != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lse_base=", call.lse_base, " must be LSE_BASE_2 (0) or LSE_BASE_E (1)"));
  }
  ValidatedPrefill out;
  PrefillTask& task = out.task;
  task.layer = call.layer;
  task.q = call.q.data.data();
  task.q_scattered = call.q.scattered;
  task.q_on_device = call.q.on_device;
  task.q_pinned = call.q.pinned;
  task.total_q = static_cast<int32_t>(layout.total_q);
  task.num_kv_indices = static_cast<int32_t>(layout.pages.size() - layout.num_append);
  task.seqs = layout.seqs;
  task.sinks = options.sinks;
  for (PrefillSeq& seq : task.seqs) {
    seq.layer = call.layer;
    seq.sm_scale = sm_scale;
    seq.causal = call.causal.value_or(true) ? 1 : 0;
    seq.lse_base_e = static_cast<uint8_t>(call.lse_base);
    seq.window_left = options.window_left;
    seq.soft_cap = options.soft_cap;
    if (options.sinks == nullptr) seq.sink_index = -1;  // else as the layout says
  }
  const int64_t n_append = layout.num_append;
  // Append tensors sent without append rows (shape [0, ...]) are checked as
  // with them: an MLA server refuses any append_v.
  if (n_append > 0 || !TensorUnset(call.append_k) || !TensorUnset(call.append_v)) {
    const int64_t kv_shape[] = {n_append, geo.num_kv_heads, geo.head_dim};
    const bool has_v = geo.HasVPool();
    ATTN_RETURN_IF_ERROR(CheckVPresence(call.append_v, "append_v", "append_k", geo));
    const TensorView& v = has_v ? call.append_v : call.append_k;
    ATTN_ASSIGN_OR_RETURN(const bool fp8,
                          KvRowsAreFp8(call.append_k, v, "append_k", "append_v", geo));
    const TensorDType rows = fp8 ? TensorDTypeOf(geo.kv_fp8) : TensorDTypeOf(geo.dtype);
    ATTN_RETURN_IF_ERROR(ValidateTensor(call.append_k, "append_k", rows, kv_shape));
    if (has_v) ATTN_RETURN_IF_ERROR(ValidateTensor(call.append_v, "append_v", rows, kv_shape));
    task.num_append = n_append;
    task.append_fp8 = fp8;
    task.append_k = call.append_k.data.data();
    task.append_v = has_v ? call.append_v.data.data() : nullptr;
    task.append_k_scattered = call.append_k.scattered;
    task.append_v_scattered = call.append_v.scattered;
    task.append_k_on_device = call.append_k.on_device;
    task.append_v_on_device = call.append_v.on_device;
    task.append_k_pinned = call.append_k.pinned;
    task.append_v_pinned = call.append_v.pinned;
  }
  out.out_bytes = layout.total_q * geo.ORowElems() * geo.QElemBytes();
  out.lse_bytes = layout.total_q * geo.num_qo_heads * static_cast<int64_t>(sizeof(float));
  ATTN_RETURN_IF_ERROR(CheckResponseSize(out.out_bytes + out.lse_bytes, limits));
  return out;
}

// q: rank 3 with total_q rows, where expected_rows (-1: any) says how many.
absl::StatusOr<int64_t> CheckQuery(const TensorView& q, int64_t expected_rows,
                                   const KvGeometry& geo, const RequestLimits& limits) {
  if (q.shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("q.shape has rank ", q.shape.size(),
                                                   ", must be [total_q, ", geo.num_qo_heads,
                                                   ", ", geo.head_dim, "]"));
  }
  const int64_t total_q = q.shape[0];
  if (total_q < 0 || total_q > limits.max_request_rows) {
    return absl::InvalidArgumentError(absl::StrCat("q.shape[0]=", total_q, " out of range [0, ",
                                                   limits.max_request_rows, "]"));
  }
  if (expected_rows >= 0 && total_q != expected_rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q.shape[0]=", total_q, " must equal the plan's query rows ", expected_rows));
  }
  const int64_t q_shape[] = {total_q, geo.num_qo_heads, geo.head_dim};
  ATTN_RETURN_IF_ERROR(ValidateTensor(q, "q", TensorDTypeOf(geo.dtype), q_shape));
  return total_q;
}

}  // namespace

absl::StatusOr<ValidatedPrefill> ValidatePrefill(const PrefillCall& call, const KvGeometry& geo,
                                                 const RequestLimits& limits,
                                                 uint64_t incarnation) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(call.expected_incarnation, incarnation));
  ATTN_RETURN_IF_ERROR(CheckLayer(call.layer, geo));
  ATTN_ASSIGN_OR_RETURN(const int64_t total_q, CheckQuery(call.q, -1, geo, limits));
  const PrefillLayout fields{call.qo_indptr,        call.kv_indptr,    call.kv_indices,
                             call.kv_last_page_len, call.append_slots, call.kv_keys_after,
                             call.apply_sinks};
  // Sequences without query rows are validated and their pages pinned, but
  // the task leaves them out (PrefillTask::seq_numbers).
  ATTN_ASSIGN_OR_RETURN(ValidatedLayout layout, ValidateLayout(fields, total_q, "q.shape[0]", geo,
                                                               limits, /*keep_empty=*/false));
  ATTN_ASSIGN_OR_RETURN(ValidatedPrefill out,
                        ValidateAgainstLayout(call, layout, nullptr, geo, limits));
  out.task.seq_numbers = std::move(layout.seq_numbers);
  // The task reads the request's own arrays.
  out.task.kv_indices = call.kv_indices.data();
  if (out.task.num_append > 0) out.task.append_slots = call.append_slots.data();
  out.pages = std::move(layout.pages);
  return out;
}

absl::StatusOr<ValidatedPrefill> ValidatePlannedPrefill(const PrefillCall& call,
                                                        const ValidatedLayout& plan,
                                                        const int32_t* kv_indices,
                                                        const int64_t* append_slots,
                                                        const PlanOptions& plan_options,
                                                        const KvGeometry& geo,
                                                        const RequestLimits& limits,
                                                        uint64_t incarnation) {
  ATTN_RETURN_IF_ERROR(CheckIncarnation(call.expected_incarnation, incarnation));
  if (!call.qo_indptr.empty() || !call.kv_indptr.empty() || !call.kv_indices.empty() ||
      !call.kv_last_page_len.empty() || !call.append_slots.empty() ||
      !call.kv_keys_after.empty() || !call.apply_sinks.empty()) {
    return absl::InvalidArgumentError(
        "plan_id is set: qo_indptr, kv_indptr, kv_indices, kv_last_page_len, append_slots, "
        "kv_keys_after and apply_sinks must be empty (the plan holds them)");
  }
  ATTN_RETURN_IF_ERROR(CheckLayer(call.layer, geo));
  ATTN_RETURN_IF_ERROR(CheckQuery(call.q, plan.total_q, geo, limits).status());
  ATTN_ASSIGN_OR_RETURN(
      ValidatedPrefill out,
      ValidateAgainstLayout(call, plan, &plan_options.For(call.layer), geo, limits));
  out.task.kv_indices = kv_indices;
  if (out.task.num_append > 0) out.task.append_slots = append_slots;
  return out;  // no pages: the plan pins them
}

}  // namespace attnserve
