#include "server/core/written_rows.h"

#include <algorithm>
#include <array>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

// The rows of one page a request appends: a bit each (page_size <= 128).
using PageBits = std::array<uint8_t, 16>;

// The first row in [0, rows) whose bit is set in neither `written` nor
// `appended` (null: none), or -1 when all are.
int32_t FirstMissing(const std::atomic<uint8_t>* written, const PageBits* appended, int32_t rows) {
  for (int32_t byte = 0; byte * 8 < rows; ++byte) {
    const int32_t in_byte = std::min(8, rows - byte * 8);
    const uint8_t want = static_cast<uint8_t>((1u << in_byte) - 1);
    uint8_t have = written[byte].load(std::memory_order_acquire);
    if (appended != nullptr) have |= (*appended)[byte];
    const uint8_t missing = static_cast<uint8_t>(want & ~have);
    if (missing != 0) return byte * 8 + __builtin_ctz(missing);
  }
  return -1;
}

}  // namespace

WrittenRows::WrittenRows(const KvGeometry& geo)
    : num_pages_(geo.num_pages),
      page_size_(geo.page_size),
      num_layers_(geo.num_layers),
      bytes_per_page_((geo.page_size + 7) / 8),
      last_byte_(static_cast<uint8_t>((1u << (geo.page_size - (geo.page_size - 1) / 8 * 8)) - 1)),
      bits_(new std::atomic<uint8_t>[static_cast<size_t>(geo.num_layers) * geo.num_pages *
                                     ((geo.page_size + 7) / 8)]),
      whole_(new std::atomic<uint8_t>[static_cast<size_t>(geo.num_layers) * geo.num_pages]),
      whole_in_(new std::atomic<int32_t>[geo.num_pages]) {
  const size_t n = static_cast<size_t>(num_layers_) * num_pages_ * bytes_per_page_;
  for (size_t i = 0; i < n; ++i) bits_[i].store(0, std::memory_order_relaxed);
  for (size_t i = 0; i < static_cast<size_t>(num_layers_) * num_pages_; ++i) {
    whole_[i].store(0, std::memory_order_relaxed);
  }
  for (int32_t p = 0; p < num_pages_; ++p) whole_in_[p].store(0, std::memory_order_relaxed);
}

bool WrittenRows::Full(const std::atomic<uint8_t>* bits) const {
  uint8_t all = 0xFF;
  for (int32_t b = 0; b + 1 < bytes_per_page_; ++b) all &= bits[b].load(std::memory_order_acquire);
  return all == 0xFF &&
         (bits[bytes_per_page_ - 1].load(std::memory_order_acquire) & last_byte_) == last_byte_;
}

void WrittenRows::Reset(absl::Span<const int32_t> pages) {
  for (int32_t page : pages) whole_in_[page].store(0, std::memory_order_release);
  for (int32_t layer = 0; layer < num_layers_; ++layer) {
    for (int32_t page : pages) {
      std::atomic<uint8_t>* bits = Bits(layer, page);
      for (int32_t b = 0; b < bytes_per_page_; ++b) bits[b].store(0, std::memory_order_release);
      whole_[static_cast<size_t>(layer) * num_pages_ + page].store(0, std::memory_order_release);
    }
  }
}

void WrittenRows::NoteWhole(int32_t layer, int32_t page) {
  if (!Full(Bits(layer, page))) return;
  if (whole_[static_cast<size_t>(layer) * num_pages_ + page].exchange(
          1, std::memory_order_acq_rel) == 0) {
    whole_in_[page].fetch_add(1, std::memory_order_acq_rel);
  }
}

void WrittenRows::Mark(int32_t layer, const int64_t* slots, int64_t n) {
  int32_t last_page = -1;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t page = static_cast<int32_t>(slots[i] / page_size_);
    const int32_t row = static_cast<int32_t>(slots[i] % page_size_);
    Bits(layer, page)[row / 8].fetch_or(static_cast<uint8_t>(1u << (row % 8)),
                                        std::memory_order_release);
    if (page != last_page && last_page >= 0) NoteWhole(layer, last_page);
    last_page = page;
  }
  if (last_page >= 0) NoteWhole(layer, last_page);
}

std::vector<WrittenRows::Position> WrittenRows::Unsettled(absl::Span<const PrefillSeq> seqs,
                                                          const int32_t* kv_indices) const {
  std::vector<Position> out;
  for (size_t s = 0; s < seqs.size(); ++s) {
    // A sequence without query rows reads nothing: not checked (as a
    // request without a plan does not keep it).
    if (seqs[s].q_len == 0) continue;
    const int32_t num_pages = (seqs[s].kv_len + page_size_ - 1) / page_size_;
    for (int32_t i = 0; i < num_pages; ++i) {
      const bool partial = i + 1 == num_pages && seqs[s].kv_len % page_size_ != 0;
      const int32_t page = kv_indices[seqs[s].kv_start + i];
      if (partial || whole_in_[page].load(std::memory_order_acquire) < num_layers_) {
        out.push_back({static_cast<int32_t>(s), i});
      }
    }
  }
  return out;
}

absl::Status WrittenRows::CheckPrefill(const PrefillTask& task,
                                       const std::vector<Position>* only) const {
  // The rows this request appends before it attends, per page.
  absl::flat_hash_map<int32_t, PageBits> appended;
  for (int64_t i = 0; i < task.num_append; ++i) {
    const int32_t page = static_cast<int32_t>(task.append_slots[i] / page_size_);
    const int32_t row = static_cast<int32_t>(task.append_slots[i] % page_size_);
    appended[page][row / 8] |= static_cast<uint8_t>(1u << (row % 8));  // new entries are zeros
  }
  const std::atomic<uint8_t>* layer_bits = Bits(task.layer, 0);
  // The page at position i of sequence s, or its error.
  auto check = [&](size_t s, int32_t i) -> absl::Status {
    const PrefillSeq& seq = task.seqs[s];
    const int32_t num_pages = (seq.kv_len + page_size_ - 1) / page_size_;
    const int32_t page = task.kv_indices[seq.kv_start + i];
    const int32_t rows = i + 1 < num_pages ? page_size_ : seq.kv_len - i * page_size_;
    // Most pages were written whole before: that is a compare per byte, and
    // the request's appends are looked up only for a page with rows missing.
    const std::atomic<uint8_t>* bits = layer_bits + static_cast<size_t>(page) * bytes_per_page_;
    if (rows == page_size_ && Full(bits)) return absl::OkStatus();
    int32_t missing = FirstMissing(bits, nullptr, rows);
    if (missing < 0) return absl::OkStatus();
    if (const auto it = appended.find(page); it != appended.end()) {
      missing = FirstMissing(bits, &it->second, rows);
      if (missing < 0) return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", task.seq_numbers.empty() ? static_cast<int64_t>(s) : task.seq_numbers[s],
        " reads rows [0, ", rows, ") of page ", page, " (kv_indices[",
        seq.kv_start + i, "]) in layer ", task.layer, ", but row ", missing,
        " was never written there (by WriteKV, or an append_slots of this or an earlier "
        "Prefill): it would be read as zeros. Write it first, or check kv_last_page_len "
        "(--check_kv_written=false turns this check off)"));
  };
  if (only != nullptr) {
    for (const Position& at : *only) {
      absl::Status status = check(static_cast<size_t>(at.seq), at.index);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }
  for (size_t s = 0; s < task.seqs.size(); ++s) {
    const int32_t num_pages = (task.seqs[s].kv_len + page_size_ - 1) / page_size_;
    for (int32_t i = 0; i < num_pages; ++i) {
      absl::Status status = check(s, i);
      if (!status.ok()) return status;
    }
  }
  return absl::OkStatus();
}

std::function<void()> WrittenRows::Marker(int32_t layer, const int64_t* slots, int64_t n,
                                          std::shared_ptr<const void> keep_alive) {
  if (n == 0) return nullptr;
  return [this, layer, slots, n, keep_alive = std::move(keep_alive)] { Mark(layer, slots, n); };
}

}  // namespace attnserve
