// WrittenRows: which KV rows hold data written since their page was
// allocated, so that a Prefill reading rows nobody wrote (they hold zeros, or
// a freed page's scrubbed contents) is refused instead of answered
// (--check_kv_written, docs/operations.md).
//
// One bit per (layer, page, row): WriteKV and a Prefill's fused appends set
// the bits of their rows when they succeed; a page going back to the free
// list has its bits cleared in every layer (PageTable's free listener), so
// a page is never allocatable with its previous owner's bits. A bit per row, not a count per page, because engines write
// out of order: a decode step that appends row 9 of a page says nothing of
// rows 0..8 in that layer. At one bit per row and layer this is 1/8 of a
// byte per KV row per layer (for 32 layers and 524,288 rows: 2 MiB).
//
//   WrittenRows written(geometry);
//   written.Reset(pages);                               // back to the free list
//   ATTN_RETURN_IF_ERROR(written.CheckPrefill(task));   // before queueing
//   job->on_success = written.Marker(layer, slots, n, nullptr);  // Scheduler::Finish
//
// Thread-safe: bits are set from the scheduler's threads while requests are
// checked on the edge's.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/kv_geometry.h"
#include "server/backend/backend.h"
#include "server/core/requests.h"

namespace attnserve {

class WrittenRows {
 public:
  explicit WrittenRows(const KvGeometry& geo);

  // Pages going back to the free list: none of their rows is written, in
  // any layer.
  void Reset(absl::Span<const int32_t> pages);

  // Marks slots[0, n) of `layer` written (validated slots).
  void Mark(int32_t layer, const int64_t* slots, int64_t n);

  // A page that CheckPrefill looks at: kv_indices[seqs[seq].kv_start + index].
  struct Position {
    int32_t seq;
    int32_t index;
  };
  // The positions of a layout whose pages CheckPrefill must look at in any
  // layer (sequences with query rows only: one without reads nothing): each
  // sequence's partial last page and every page not yet whole
  // (all its rows written) in every layer. A page whole in every layer stays
  // so while it is pinned (only its return to the free list clears it), so a plan
  // takes these once, after pinning its pages, for its requests of every
  // layer: a decode step's 32 layers then look at a few pages per sequence
  // each rather than at all of them.
  std::vector<Position> Unsettled(absl::Span<const PrefillSeq> seqs,
                                  const int32_t* kv_indices) const;

  // FAILED_PRECONDITION naming the sequence, the page, the first row missing
  // and the rows read when a sequence of `task` (validated, its pages owned
  // by the caller) reads a row of its layer that neither an earlier request
  // nor this request's own appended slots wrote. With `only` (Unsettled of
  // the task's layout, its pages pinned since), the pages at those positions
  // alone are looked at.
  absl::Status CheckPrefill(const PrefillTask& task,
                            const std::vector<Position>* only = nullptr) const;

  // A function that marks slots[0, n) of `layer` (empty for n = 0), for
  // Job::on_success: the scheduler runs it when the job succeeded, before it
  // unpins the job's pages, so that a page its owner freed while the job ran
  // cannot be marked after it was scrubbed and given to another tenant. The
  // slots must live as long as the function; `keep_alive` (the plan that
  // holds them) is held by it, and so released with the job, before the
  // answer.
  std::function<void()> Marker(int32_t layer, const int64_t* slots, int64_t n,
                               std::shared_ptr<const void> keep_alive);

 private:
  // The first byte of the bits of (layer, page): row r is bit r % 8 of byte
  // r / 8.
  std::atomic<uint8_t>* Bits(int32_t layer, int32_t page) const {
    return &bits_[(static_cast<size_t>(layer) * num_pages_ + page) * bytes_per_page_];
  }

  // Every row of a page written.
  bool Full(const std::atomic<uint8_t>* bits) const;
  // After rows of (layer, page) were marked: counts the page whole in `layer`
  // once it is (whole_in_ counts each layer once).
  void NoteWhole(int32_t layer, int32_t page);

  const int32_t num_pages_;
  const int32_t page_size_;       // 1..128
  const int32_t num_layers_;
  const int32_t bytes_per_page_;  // ceil(page_size / 8)
  const uint8_t last_byte_;       // the bits of a whole page's last byte
  // (num_layers, num_pages, bytes_per_page): a bit per row, set once written.
  std::unique_ptr<std::atomic<uint8_t>[]> bits_;
  // (num_layers, num_pages): 1 once the page is whole in that layer.
  std::unique_ptr<std::atomic<uint8_t>[]> whole_;
  // (num_pages): the layers in which the page is whole. A write may go
  // uncounted when two finish a page at once (the page is then looked at
  // each time, never skipped unwritten).
  std::unique_ptr<std::atomic<int32_t>[]> whole_in_;
};

}  // namespace attnserve
