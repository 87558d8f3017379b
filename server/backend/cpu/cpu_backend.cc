#include "server/backend/cpu/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/append_kv.h"
#include "kernels/paged_prefill.h"

namespace attnserve {
namespace {

// Inline inputs that arrived in pieces, or at an odd address in gRPC's
// bytes, are copied into scratch the reference kernels may read as 16-bit
// elements: at most this many bytes at a time, so that a request costs about
// its size in memory (its bytes in gRPC's slices) and not twice that.
constexpr int64_t kFlatChunkBytes = int64_t{1} << 20;

bool NeedsFlat(const void* data, const ScatterList& scattered) {
  return !scattered.empty() || reinterpret_cast<uintptr_t>(data) % alignof(uint16_t) != 0;
}

// Rows [first, first + n) of an input of row_bytes-byte rows: in place when
// it needs no flattening, else copied into *scratch.
const void* Rows(const void* data, const ScatterList& scattered, int64_t row_bytes, int64_t first,
                 int64_t n, std::vector<uint16_t>* scratch) {
  if (!NeedsFlat(data, scattered)) return static_cast<const char*>(data) + first * row_bytes;
  scratch->resize(static_cast<size_t>((n * row_bytes + 1) / 2));
  if (scattered.empty()) {
    std::memcpy(scratch->data(), static_cast<const char*>(data) + first * row_bytes,
                static_cast<size_t>(n * row_bytes));
  } else {
    CopyOut(scattered, first * row_bytes, n * row_bytes, scratch->data());
  }
  return scratch->data();
}

// A sequence's query rows [first, first + n) as a sequence of their own
// that keeps their key positions (kernels/variant.h's QueryPos: row i of
// q_len is at i + kv_len - q_len + causal_shift), so the causal diagonal and
// the window stay where they were; q_start moves by `first`.
PrefillSeq RowsOf(const PrefillSeq& seq, int32_t first, int32_t n) {
  PrefillSeq part = seq;
  part.q_start = seq.q_start + first;
  part.q_len = n;
  part.causal_shift = seq.causal_shift + first + n - seq.q_len;
  return part;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CpuBackend::Create(const KvGeometry& geometry) {
  std::unique_ptr<CpuBackend> backend(new CpuBackend(geometry));
  try {
    // MLA: the latent pool alone.
    backend->k_pool_.assign(geometry.PoolBytes(), 0);
    if (geometry.HasVPool()) backend->v_pool_.assign(geometry.PoolBytes(), 0);
    const size_t scales = static_cast<size_t>(geometry.num_layers) * geometry.num_kv_heads;
    backend->k_scales_.assign(scales, 1.f);
    backend->v_scales_.assign(scales, 1.f);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate the KV cache in host memory: ", geometry.NumPools() * geometry.PoolBytes(),
        " bytes"));
  }
  return std::unique_ptr<Backend>(std::move(backend));
}

std::string CpuBackend::Device() const {
  return absl::StrCat("cpu (", std::thread::hardware_concurrency(), " threads)");
}

void CpuBackend::Append(int32_t layer, const int64_t* slots, int64_t n, const void* k,
                        const ScatterList& k_scattered, const void* v,
                        const ScatterList& v_scattered, bool rows_fp8) {
  const int64_t row_bytes = rows_fp8 ? geo_.KvRowBytes() : geo_.RowElems() * geo_.QElemBytes();
  // In chunks of rows when an input needs flattening; in order, so that a
  // later row written to the same slot still wins.
  const int64_t chunk = NeedsFlat(k, k_scattered) || NeedsFlat(v, v_scattered)
                            ? std::max<int64_t>(1, kFlatChunkBytes / row_bytes)
                            : std::max<int64_t>(n, 1);
  std::vector<uint16_t> k_flat, v_flat;
  for (int64_t first = 0; first < n; first += chunk) {
    const int64_t rows = std::min(chunk, n - first);
    AppendKvParams a;
    a.k_cache = k_pool_.data();
    a.v_cache = v_pool_.data();
    a.k = Rows(k, k_scattered, row_bytes, first, rows, &k_flat);
    a.v = geo_.HasVPool() ? Rows(v, v_scattered, row_bytes, first, rows, &v_flat) : nullptr;
    a.slots = slots + first;
    a.n = rows;
    a.layer = layer;
    a.geo = geo_;
    a.rows_fp8 = rows_fp8;
    a.k_scales = k_scales_.data();
    a.v_scales = v_scales_.data();
    AppendKvCpu(a);
  }
}

bool CpuBackend::Attend(const PrefillTask& t) {
  PagedPrefillParams p;
  p.k_cache = k_pool_.data();
  p.v_cache = geo_.HasVPool() ? v_pool_.data() : k_pool_.data();  // MLA: V is in K's rows
  p.kv_indices = t.kv_indices;
  p.sinks = t.sinks;  // the task's one set: its seqs' sink_index is 0 or -1
  p.k_scales = k_scales_.data();
  p.v_scales = v_scales_.data();
  p.geo = geo_;
  // The kernel asks given_up before each part of its work (a few rows of a
  // KV head over their keys): a caller that gave up stops it there.
  const std::function<bool()>* stop = t.given_up ? &t.given_up : nullptr;
  if (!NeedsFlat(t.q, t.q_scattered)) {
    p.q = t.q;
    p.o = t.o;
    p.lse = t.lse;
    p.seqs = t.seqs.data();
    p.num_seqs = static_cast<int32_t>(t.seqs.size());
    p.total_q = t.total_q;
    return PagedPrefillCpu(p, stop);
  }
  // The query flattened a chunk of rows at a time, each chunk of a sequence
  // run as a sequence of its own (RowsOf).
  const int64_t row_bytes = geo_.QRowElems() * geo_.QElemBytes();
  const int64_t o_row_bytes = geo_.ORowElems() * geo_.QElemBytes();
  const int32_t chunk = static_cast<int32_t>(std::max<int64_t>(1, kFlatChunkBytes / row_bytes));
  std::vector<uint16_t> q_flat;
  for (const PrefillSeq& seq : t.seqs) {
    for (int32_t first = 0; first < seq.q_len; first += chunk) {
      PrefillSeq part = RowsOf(seq, first, std::min(chunk, seq.q_len - first));
      const int64_t row = part.q_start;
      part.q_start = 0;
      p.q = Rows(t.q, t.q_scattered, row_bytes, row, part.q_len, &q_flat);
      p.o = static_cast<char*>(t.o) + row * o_row_bytes;
      p.lse = t.lse + row * geo_.num_qo_heads;
      p.seqs = &part;
      p.num_seqs = 1;
      p.total_q = part.q_len;
      if (!PagedPrefillCpu(p, stop)) return false;
    }
  }
  return true;
}

absl::Status CpuBackend::Submit(absl::Span<const PrefillTask> tasks, BatchStats* stats) {
  if (pending_) return absl::FailedPreconditionError("the CPU backend holds one batch at a time");
  const absl::Time start = absl::Now();
  BatchStats s;
  for (const PrefillTask& t : tasks) {
    if (t.num_append == 0) continue;
    Append(t.layer, t.append_slots, t.num_append, t.append_k, t.append_k_scattered, t.append_v,
           t.append_v_scattered, t.append_fp8);
    ++s.append_launches;
  }
  const absl::Time appended = absl::Now();
  s.append_seconds = absl::ToDoubleSeconds(appended - start);
  for (const PrefillTask& t : tasks) s.given_up_tasks += Attend(t) ? 0 : 1;
  // The CPU backend's "launch" is one pass over the whole batch.
  s.attention_launches = 1;
  s.attention_seconds = absl::ToDoubleSeconds(absl::Now() - appended);
  if (stats != nullptr) stats->submit_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  pending_stats_ = s;
  pending_ = true;
  return absl::OkStatus();
}

absl::Status CpuBackend::Complete(BatchStats* stats) {
  if (!pending_) return absl::FailedPreconditionError("no batch was submitted");
  pending_ = false;
  if (stats == nullptr) return absl::OkStatus();
  stats->append_launches += pending_stats_.append_launches;
  stats->append_seconds += pending_stats_.append_seconds;
  stats->attention_launches += pending_stats_.attention_launches;
  stats->attention_seconds += pending_stats_.attention_seconds;
  stats->given_up_tasks += pending_stats_.given_up_tasks;
  return absl::OkStatus();
}

absl::Status CpuBackend::WriteKv(const KvRows& rows, BatchStats* stats) {
  const absl::Time start = absl::Now();
  Append(rows.layer, rows.slots, rows.n, rows.k, rows.k_scattered, rows.v, rows.v_scattered,
         rows.rows_fp8);
  if (stats != nullptr) {
    stats->kv_rows_launches += 1;
    stats->kv_rows_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) {
  const absl::Time start = absl::Now();
  // Pool layout (layer, page, slot in page, KV head, dim).
  const int64_t page_bytes = int64_t{geo_.page_size} * geo_.KvRowBytes();
  for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
    for (int32_t page : pages) {
      const int64_t at = (int64_t{layer} * geo_.num_pages + page) * page_bytes;
      std::fill_n(k_pool_.begin() + at, page_bytes, uint8_t{0});
      if (geo_.HasVPool()) std::fill_n(v_pool_.begin() + at, page_bytes, uint8_t{0});
    }
  }
  if (stats != nullptr) {
    stats->zero_launches += 1;
    stats->zero_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ReadKv(const KvRows& rows, BatchStats* stats) {
  const absl::Time start = absl::Now();
  GatherKvParams g;
  g.k_cache = k_pool_.data();
  g.v_cache = v_pool_.data();
  g.k = rows.k;
  g.v = rows.v;
  g.slots = rows.slots;
  g.n = rows.n;
  g.layer = rows.layer;
  g.geo = geo_;
  g.dequantize = geo_.KvIsFp8() && !rows.rows_fp8;
  g.k_scales = k_scales_.data();
  g.v_scales = v_scales_.data();
  GatherKvCpu(g);
  if (stats != nullptr) {
    stats->kv_rows_launches += 1;
    stats->kv_rows_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::SetKvScales(int32_t layer, absl::Span<const float> k_scales,
                                     absl::Span<const float> v_scales) {
  if (!geo_.KvIsFp8()) {
    return absl::FailedPreconditionError("KV scales apply to an FP8 KV cache only");
  }
  const size_t heads = static_cast<size_t>(geo_.num_kv_heads);
  if (layer < 0 || layer >= geo_.num_layers || k_scales.size() != heads ||
      v_scales.size() != heads) {
    return absl::InvalidArgumentError("SetKvScales: a layer out of range or not num_kv_heads scales");
  }
  std::copy(k_scales.begin(), k_scales.end(), k_scales_.begin() + int64_t{layer} * heads);
  std::copy(v_scales.begin(), v_scales.end(), v_scales_.begin() + int64_t{layer} * heads);
  return absl::OkStatus();
}

}  // namespace attnserve
