#include "server/backend.h"

#include <cstdlib>
#include <memory>
#include <vector>

namespace attnserve {

absl::Status Backend::ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) {
  // Rows per WriteKv call; the zero source is calloc'ed, so its pages are
  // the kernel's shared zero page until written (never).
  constexpr int64_t kRowsPerCall = 4096;
  const KvGeometry& g = Geometry();
  const int64_t row_bytes = g.RowElems() * KvDTypeBytes(g.dtype);
  std::unique_ptr<void, decltype(&std::free)> zeros(std::calloc(kRowsPerCall, row_bytes), &std::free);
  if (zeros == nullptr) return absl::ResourceExhaustedError("cannot allocate the zero rows for a page scrub");
  std::vector<int64_t> slots;
  slots.reserve(kRowsPerCall);
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    auto flush = [&]() -> absl::Status {
      if (slots.empty()) return absl::OkStatus();
      KvRows rows;
      rows.layer = layer;
      rows.slots = slots.data();
      rows.n = static_cast<int64_t>(slots.size());
      rows.k = zeros.get();
      rows.v = zeros.get();
      absl::Status st = WriteKv(rows, stats);
      slots.clear();
      return st;
    };
    for (int32_t page : pages) {
      for (int64_t j = 0; j < g.page_size; ++j) {
        slots.push_back(int64_t{page} * g.page_size + j);
        if (static_cast<int64_t>(slots.size()) == kRowsPerCall) {
          if (absl::Status st = flush(); !st.ok()) return st;
        }
      }
    }
    if (absl::Status st = flush(); !st.ok()) return st;
  }
  return absl::OkStatus();
}

}  // namespace attnserve
