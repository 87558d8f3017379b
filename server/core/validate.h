// Validation of every request field before anything is queued
// (docs/design.md section 4). Pure functions: no page table, no device. Errors
// name the field and the bound; the code is INVALID_ARGUMENT for malformed
// input, RESOURCE_EXHAUSTED for sizes over a limit and FAILED_PRECONDITION
// for a stale expected_incarnation.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/kv_geometry.h"
#include "server/backend.h"
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

absl::StatusOr<ValidatedPrefill> ValidatePrefill(const PrefillCall& call,
                                                 const KvGeometry& geo,
                                                 const RequestLimits& limits,
                                                 uint64_t incarnation);

// WriteKV / ReadKV: layer and slots; for WriteKV also k and v (pass nullptr
// for ReadKV). Returns the page of each slot (repeats allowed).
absl::StatusOr<std::vector<int32_t>> ValidateKvRows(int32_t layer,
                                                    absl::Span<const int64_t> slots,
                                                    const TensorView* k, const TensorView* v,
                                                    const KvGeometry& geo,
                                                    const RequestLimits& limits);

// MergeStates: every state the same (n, h, d), v in kv dtype, lse float32.
struct MergeShape {
  int64_t n = 0;
  int32_t h = 0;
  int32_t d = 0;
};
absl::StatusOr<MergeShape> ValidateMerge(const MergeStatesCall& call, const KvGeometry& geo,
                                         const RequestLimits& limits);

// Checks a tensor's dtype, shape and byte size. `field` names it in errors.
absl::Status ValidateTensor(const TensorView& t, absl::string_view field, WireDType dtype,
                            absl::Span<const int64_t> shape);

WireDType ToWire(KvDType dtype);

}  // namespace attnserve
