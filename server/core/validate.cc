// Validation of writes, reads, scales and merges, and of the tensors and
// slots every request names (Prefill calls: validate_prefill.cc).
#include "server/core/validate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/core/status_macros.h"
#include "server/core/validate_internal.h"

namespace attnserve {
namespace {

// Bytes per element of the dtypes a field may require.
int64_t DTypeBytes(TensorDType dtype) { return TensorDTypeBytes(dtype); }

}  // namespace

// The checks validate_prefill.cc shares (validate_internal.h).
namespace validate_detail {

absl::Status CheckLayer(int32_t layer, const KvGeometry& geo) {
  if (layer < 0 || layer >= geo.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer=", layer, " out of range [0, ", geo.num_layers, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckResponseSize(int64_t bytes, const RequestLimits& limits) {
  if (bytes > limits.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "response of ", bytes, " bytes exceeds max_message_bytes=", limits.max_message_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> CheckSlots(absl::Span<const int64_t> slots,
                                                absl::string_view field,
                                                const KvGeometry& geo) {
  const int64_t max_slot = geo.SlotsPerLayer();
  absl::flat_hash_set<int64_t> seen;
  seen.reserve(slots.size());
  std::vector<int32_t> pages;
  pages.reserve(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t s = slots[i];
    if (s < 0 || s >= max_slot) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]=", s, " out of range [0, ",
                                                     max_slot, ") (num_pages * page_size)"));
    }
    if (!seen.insert(s).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]=", s, " is repeated"));
    }
    pages.push_back(static_cast<int32_t>(s / geo.page_size));
  }
  return pages;  // one entry per slot: pins are counts, repeats are fine
}

}  // namespace validate_detail

using validate_detail::CheckLayer;
using validate_detail::CheckResponseSize;
using validate_detail::CheckSlots;
using validate_detail::TensorUnset;
using validate_detail::CheckVPresence;

absl::Status ValidateTensor(const TensorView& t, absl::string_view field, TensorDType dtype,
                            absl::Span<const int64_t> shape) {
  if (t.dtype != dtype) {
    if (TensorUnset(t)) {
      return absl::InvalidArgumentError(absl::StrCat(field, " is unset: must be a ", TensorDTypeName(dtype),
                                                     " tensor of shape [", absl::StrJoin(shape, ", "), "]"));
    }
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype=", TensorDTypeName(t.dtype),
                                                   " must be ", TensorDTypeName(dtype)));
  }
  if (t.shape.size() != shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape has rank ", t.shape.size(),
                                                   ", must be [", absl::StrJoin(shape, ", "),
                                                   "]"));
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (t.shape[i] != shape[i]) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape[", i, "]=", t.shape[i],
                                                     " must be ", shape[i], " (shape [",
                                                     absl::StrJoin(shape, ", "), "])"));
    }
  }
  int64_t elems = 1;
  for (int64_t dim : shape) elems *= dim;
  const int64_t bytes = elems * DTypeBytes(dtype);
  if (t.byte_size() != bytes && t.region.set) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".region.byte_size=", t.byte_size(),
                                                   ", shape [", absl::StrJoin(shape, ", "),
                                                   "] needs ", bytes));
  }
  if (t.byte_size() != bytes) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data has ", t.byte_size(),
                                                   " bytes, shape [", absl::StrJoin(shape, ", "),
                                                   "] needs ", bytes));
  }
  return absl::OkStatus();
}

bool validate_detail::TensorUnset(const TensorView& t) {
  return t.dtype == TensorDType::kUnspecified && t.shape.empty() && t.byte_size() == 0 && !t.region.set;
}

absl::Status validate_detail::CheckVPresence(const TensorView& v, absl::string_view v_field,
                            absl::string_view k_field, const KvGeometry& geo) {
  if (TensorUnset(v) == !geo.HasVPool()) return absl::OkStatus();
  if (!geo.HasVPool()) {
    return absl::InvalidArgumentError(absl::StrCat(
        v_field, " must be unset: an MLA server (--attention=mla) takes one latent row per slot "
        "in ", k_field, " (kv_lora_rank + qk_rope_head_dim values; the first kv_lora_rank are "
        "its V)"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      v_field, " is unset: this GQA server takes K rows in ", k_field, " and V rows in ", v_field,
      ", [n, ", geo.num_kv_heads, ", ", geo.head_dim,
      "] each (latent rows in k alone are for an --attention=mla server)"));
}

absl::StatusOr<bool> KvRowsAreFp8(const TensorView& k, const TensorView& v,
                                  absl::string_view k_field, absl::string_view v_field,
                                  const KvGeometry& geo) {
  const TensorDType half = TensorDTypeOf(geo.dtype);
  if (!geo.KvIsFp8()) {
    for (auto [field, t] : {std::pair{k_field, &k}, std::pair{v_field, &v}}) {
      if (t->dtype == TensorDType::kFp8E4m3 || t->dtype == TensorDType::kFp8E5m2) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".dtype=", TensorDTypeName(t->dtype), ": this server's KV cache is ",
            TensorDTypeName(half), " (--kv_dtype), which takes ", TensorDTypeName(half),
            " rows only; FP8 rows need a server started with --kv_dtype=fp8_e4m3 or fp8_e5m2"));
      }
    }
    return false;  // ValidateTensor names any other dtype
  }
  const TensorDType fp8 = TensorDTypeOf(geo.kv_fp8);
  if (k.dtype != half && k.dtype != fp8) {
    return absl::InvalidArgumentError(absl::StrCat(
        k_field, TensorUnset(k) ? " is unset:" : absl::StrCat(".dtype=", TensorDTypeName(k.dtype)),
        " must be ", TensorDTypeName(half),
        " (quantized by the server) or ", TensorDTypeName(fp8),
        " (stored as it is): this server's KV cache is ", Fp8FormatName(geo.kv_fp8)));
  }
  if (v.dtype != k.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(v_field, ".dtype=", TensorDTypeName(v.dtype),
                                                   " must equal ", k_field, ".dtype=",
                                                   TensorDTypeName(k.dtype)));
  }
  return k.dtype == fp8;
}

absl::Status ValidateKvScales(absl::Span<const LayerScalesView> layers, const KvGeometry& geo) {
  if (!geo.KvIsFp8()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers: KV scales apply to an FP8 KV cache, and this server's is ",
        TensorDTypeName(TensorDTypeOf(geo.dtype)),
        " (start it with --kv_dtype=fp8_e4m3 or fp8_e5m2 for scales)"));
  }
  if (layers.empty()) return absl::InvalidArgumentError("layers is empty: needs at least 1 entry");
  std::vector<bool> seen(static_cast<size_t>(geo.num_layers), false);
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerScalesView& l = layers[i];
    const std::string at = absl::StrCat("layers[", i, "]");
    if (l.layer < 0 || l.layer >= geo.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".layer=", l.layer, " out of range [0, ",
                                                     geo.num_layers, ") (num_layers)"));
    }
    if (seen[l.layer]) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ".layer=", l.layer, " is repeated: one entry per layer"));
    }
    seen[l.layer] = true;
    for (auto [name, scales, most] :
         {std::tuple{"k_scale", l.k_scale, kMaxKScale}, std::tuple{"v_scale", l.v_scale, kMaxVScale}}) {
      if (scales.size() != 1 && static_cast<int64_t>(scales.size()) != geo.num_kv_heads) {
        return absl::InvalidArgumentError(absl::StrCat(
            at, ".", name, " has ", scales.size(), " entries, must have 1 (the whole layer) or "
            "num_kv_heads=", geo.num_kv_heads, " (one per KV head)"));
      }
      for (size_t h = 0; h < scales.size(); ++h) {
        const float x = scales[h];
        if (!(x > 0.f && x <= most)) {
          return absl::InvalidArgumentError(absl::StrCat(
              at, ".", name, "[", h, "]=", x, " must be finite and in (0, ", most,
              "] (real value = fp8 value x scale)"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> ValidateKvRows(int32_t layer,
                                                    absl::Span<const int64_t> slots,
                                                    const TensorView* k, const TensorView* v,
                                                    const KvGeometry& geo,
                                                    const RequestLimits& limits, bool* rows_fp8) {
  ATTN_RETURN_IF_ERROR(CheckLayer(layer, geo));
  const int64_t n = static_cast<int64_t>(slots.size());
  if (n > limits.max_request_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("slots has ", n, " entries, at most ", limits.max_request_rows));
  }
  if (k != nullptr) {
    const int64_t shape[] = {n, geo.num_kv_heads, geo.head_dim};
    const bool has_v = geo.HasVPool();
    ATTN_RETURN_IF_ERROR(CheckVPresence(*v, "v", "k", geo));
    ATTN_ASSIGN_OR_RETURN(const bool fp8, KvRowsAreFp8(*k, has_v ? *v : *k, "k", "v", geo));
    const TensorDType rows = fp8 ? TensorDTypeOf(geo.kv_fp8) : TensorDTypeOf(geo.dtype);
    ATTN_RETURN_IF_ERROR(ValidateTensor(*k, "k", rows, shape));
    if (has_v) ATTN_RETURN_IF_ERROR(ValidateTensor(*v, "v", rows, shape));
    if (rows_fp8 != nullptr) *rows_fp8 = fp8;
  } else {
    const bool fp8 = rows_fp8 != nullptr && *rows_fp8;
    const int64_t elem = fp8 ? geo.KvElemBytes() : geo.QElemBytes();
    ATTN_RETURN_IF_ERROR(CheckResponseSize(geo.NumPools() * n * geo.RowElems() * elem, limits));
  }
  return CheckSlots(slots, "slots", geo);
}

absl::StatusOr<MergeShape> ValidateMerge(const MergeStatesCall& call, const KvGeometry& geo,
                                         const RequestLimits& limits) {
  if (call.v.empty()) {
    return absl::InvalidArgumentError("states is empty: needs at least 1 state");
  }
  if (static_cast<int64_t>(call.v.size()) > kMaxMergeStates) {
    return absl::InvalidArgumentError(absl::StrCat("states has ", call.v.size(),
                                                   " entries, at most ", kMaxMergeStates,
                                                   " (max_merge_states)"));
  }
  if (call.lse_base != 0 && call.lse_base != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lse_base=", call.lse_base, " must be LSE_BASE_2 (0) or LSE_BASE_E (1)"));
  }
  const TensorView& first = call.v[0];
  if (first.shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("states[0].v.shape has rank ",
                                                   first.shape.size(), ", must be [n, h, d]"));
  }
  MergeShape shape;
  // n is bounded too, so that the byte counts below cannot overflow int64.
  if (first.shape[0] < 0 || first.shape[0] > limits.max_message_bytes ||
      first.shape[1] <= 0 || first.shape[2] <= 0 || first.shape[1] > 4096 ||
      first.shape[2] > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "states[0].v.shape=[", absl::StrJoin(first.shape, ", "),
        "] out of range: 0 <= n <= max_message_bytes=", limits.max_message_bytes,
        ", 1 <= h <= 4096, 1 <= d <= 1024"));
  }
  shape.n = first.shape[0];
  shape.h = static_cast<int32_t>(first.shape[1]);
  shape.d = static_cast<int32_t>(first.shape[2]);
  const int64_t rows = shape.n * shape.h;
  const int64_t v_bytes = rows * shape.d * geo.QElemBytes();
  ATTN_RETURN_IF_ERROR(CheckResponseSize(v_bytes + rows * 4, limits));
  const int64_t v_shape[] = {shape.n, shape.h, shape.d};
  const int64_t lse_shape[] = {shape.n, shape.h};
  for (size_t i = 0; i < call.v.size(); ++i) {
    ATTN_RETURN_IF_ERROR(ValidateTensor(call.v[i], absl::StrCat("states[", i, "].v"),
                                        TensorDTypeOf(geo.dtype), v_shape));
    ATTN_RETURN_IF_ERROR(ValidateTensor(call.lse[i], absl::StrCat("states[", i, "].lse"),
                                        TensorDType::kFp32, lse_shape));
    if (!call.v[i].scattered.empty() || !call.lse[i].scattered.empty()) {
      // The edge parses MergeStates' tensors into the message (contiguous).
      return absl::InternalError(
          absl::StrCat("states[", i, "]: MergeStates takes contiguous tensors only"));
    }
    // LSEs in device memory (a CUDA region) are not read here: the host may
    // not touch them (docs/transport.md: their values are not checked).
    if (call.lse[i].on_device) continue;
    const auto* lse = reinterpret_cast<const float*>(call.lse[i].data.data());
    for (int64_t r = 0; r < rows; ++r) {
      float l;
      std::memcpy(&l, lse + r, sizeof(l));
      if (std::isnan(l) || l == std::numeric_limits<float>::infinity()) {
        return absl::InvalidArgumentError(absl::StrCat("states[", i, "].lse[", r, "]=", l,
                                                       " must be finite or -inf"));
      }
    }
  }
  return shape;
}

}  // namespace attnserve
