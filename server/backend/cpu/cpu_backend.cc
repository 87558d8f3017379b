#include "server/backend/cpu/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/append_kv.h"
#include "kernels/paged_prefill.h"

namespace attnserve {

absl::StatusOr<std::unique_ptr<Backend>> CpuBackend::Create(const KvGeometry& geometry) {
  std::unique_ptr<CpuBackend> backend(new CpuBackend(geometry));
  try {
    backend->k_pool_.assign(geometry.PoolElems(), 0);
    backend->v_pool_.assign(geometry.PoolElems(), 0);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate the KV cache in host memory: ",
        2 * geometry.PoolElems() * KvDTypeBytes(geometry.dtype), " bytes"));
  }
  return std::unique_ptr<Backend>(std::move(backend));
}

std::string CpuBackend::Device() const {
  return absl::StrCat("cpu (", std::thread::hardware_concurrency(), " threads)");
}

Backend::MemoryUsage CpuBackend::Memory() const {
  MemoryUsage m;
  m.used_bytes = static_cast<int64_t>((k_pool_.size() + v_pool_.size()) * sizeof(uint16_t));
  m.total_bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  return m;
}

void CpuBackend::Append(int32_t layer, const int64_t* slots, int64_t n, const void* k,
                        const void* v) {
  AppendKvParams a;
  a.k_cache = k_pool_.data();
  a.v_cache = v_pool_.data();
  a.k = k;
  a.v = v;
  a.slots = slots;
  a.n = n;
  a.layer = layer;
  a.geo = geo_;
  AppendKvCpu(a);
}

absl::Status CpuBackend::Submit(absl::Span<const PrefillTask> tasks, BatchStats* stats) {
  if (pending_) return absl::FailedPreconditionError("the CPU backend holds one batch at a time");
  const absl::Time start = absl::Now();
  BatchStats s;
  for (const PrefillTask& t : tasks) {
    if (t.num_append == 0) continue;
    Append(t.layer, t.append_slots, t.num_append, t.append_k, t.append_v);
    ++s.append_launches;
  }
  const absl::Time appended = absl::Now();
  s.append_seconds = absl::ToDoubleSeconds(appended - start);
  for (const PrefillTask& t : tasks) {
    PagedPrefillParams p;
    p.q = t.q;
    p.o = t.o;
    p.lse = t.lse;
    p.k_cache = k_pool_.data();
    p.v_cache = v_pool_.data();
    p.kv_indices = t.kv_indices;
    p.seqs = t.seqs.data();
    p.num_seqs = static_cast<int32_t>(t.seqs.size());
    p.total_q = t.total_q;
    p.geo = geo_;
    PagedPrefillCpu(p);
  }
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
  return absl::OkStatus();
}

absl::Status CpuBackend::WriteKv(const KvRows& rows, BatchStats* stats) {
  const absl::Time start = absl::Now();
  Append(rows.layer, rows.slots, rows.n, rows.k, rows.v);
  if (stats != nullptr) {
    stats->kv_rows_launches += 1;
    stats->kv_rows_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) {
  const absl::Time start = absl::Now();
  // Pool layout (layer, page, slot in page, KV head, dim).
  const int64_t page_elems = int64_t{geo_.page_size} * geo_.RowElems();
  for (int32_t layer = 0; layer < geo_.num_layers; ++layer) {
    for (int32_t page : pages) {
      const int64_t at = (int64_t{layer} * geo_.num_pages + page) * page_elems;
      std::fill_n(k_pool_.begin() + at, page_elems, uint16_t{0});
      std::fill_n(v_pool_.begin() + at, page_elems, uint16_t{0});
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
  GatherKvCpu(g);
  if (stats != nullptr) {
    stats->kv_rows_launches += 1;
    stats->kv_rows_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  }
  return absl::OkStatus();
}

}  // namespace attnserve
