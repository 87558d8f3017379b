// Checks that validate.cc and validate_prefill.cc share (not part of the
// core's interface: validate.h is).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/core/validate.h"

namespace attnserve {
namespace validate_detail {

// layer in [0, num_layers).
absl::Status CheckLayer(int32_t layer, const KvGeometry& geo);
// RESOURCE_EXHAUSTED when a response of `bytes` would pass max_message_bytes.
absl::Status CheckResponseSize(int64_t bytes, const RequestLimits& limits);
// Slots in [0, num_pages * page_size), distinct. Returns the page of each slot.
absl::StatusOr<std::vector<int32_t>> CheckSlots(absl::Span<const int64_t> slots, absl::string_view field,
                                                const KvGeometry& geo);
// A tensor field the request left out: no dtype, shape, bytes or region.
bool TensorUnset(const TensorView& t);
// Whether a write's V field (v, append_v) is present as the geometry wants:
// an MLA server's writes carry one latent row per slot in k and no V; a GQA
// server's carry V rows beside K's (one left unset entirely is named as
// such: an MLA client talking to a GQA server).
absl::Status CheckVPresence(const TensorView& v, absl::string_view v_field, absl::string_view k_field,
                            const KvGeometry& geo);

}  // namespace validate_detail
}  // namespace attnserve
