#include "server/backend/cuda/batch_packer.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "server/backend/cuda/staging_packer.h"

namespace attnserve {
namespace {

// Smallest KV chunk (tokens) worth a split work item of its own.
constexpr int32_t kMinChunk = 512;

// Adds a device-to-device copy, merged into the last one when both its
// source and its destination continue it.
// Inputs in page-locked host memory (registered system regions) at least
// this large are copied by the device straight from the region; smaller ones
// are cheaper to gather into the staging with the rest of the batch.
constexpr int64_t kMinDirectCopyBytes = int64_t{64} << 10;

void AddDeviceCopy(std::vector<PackedBatch::DeviceCopy>* copies, int64_t dst, const void* src, int64_t bytes) {
  if (!copies->empty()) {
    PackedBatch::DeviceCopy& last = copies->back();
    if (last.dst + last.bytes == dst && static_cast<const uint8_t*>(last.src) + last.bytes == src) {
      last.bytes += bytes;
      return;
    }
  }
  copies->push_back({dst, src, bytes});
}

}  // namespace

int64_t BatchPacker::InputCapacity() const {
  const int64_t q_row = geo_.QRowElems() * geo_.QElemBytes();
  // Appended rows: geo.dtype rows, or FP8 rows (no larger) in sections of
  // their own (two more alignments); K's alone without a V pool (MLA).
  const int64_t kv_row = geo_.RowElems() * geo_.QElemBytes();
  // A sink set per task, and a task has at least one row.
  const int64_t sink_sets = limits_.max_rows * geo_.num_qo_heads * 4;
  const int64_t items = geo_.IsMla() ? limits_.max_items * int64_t{sizeof(MlaWorkItem)}
                                     : limits_.max_items * int64_t{sizeof(PrefillWorkItem)};
  const int64_t merges = geo_.IsMla() ? MlaMaxMerges(limits_.mla) * int64_t{sizeof(MlaMergeTile)}
                                      : limits_.max_rows * int64_t{sizeof(SplitMergeSeq)};
  return AlignUp(limits_.max_rows * q_row) + AlignUp(limits_.max_indices * 4) +
         AlignUp(limits_.max_rows * int64_t{sizeof(PrefillSeq)}) + AlignUp(sink_sets) + AlignUp(items) +
         AlignUp(limits_.max_decode_items * int64_t{sizeof(DecodeWorkItem)}) + AlignUp(merges) +
         AlignUp(limits_.max_append * 8) + geo_.NumPools() * AlignUp(limits_.max_append * kv_row) +
         3 * kStagingAlign;
}

int64_t BatchPacker::OutputCapacity() const {
  const int64_t o_row = geo_.ORowElems() * geo_.QElemBytes();
  return AlignUp(limits_.max_rows * o_row) + AlignUp(limits_.max_rows * geo_.num_qo_heads * 4) + kStagingAlign;
}

absl::Status BatchPacker::Flatten(absl::Span<const PrefillTask> tasks, PackedBatch* out, int64_t* total_idx) {
  int64_t total_q = 0, idx = 0, total_append = 0;
  seqs_.clear();
  sinks_.clear();
  out->any_soft_cap = false;
  out->mean_kv_per_row = 0;
  for (const PrefillTask& t : tasks) {
    int32_t sink_set = -1;  // this task's set in sinks_, once a sequence uses it
    for (const PrefillSeq& s : t.seqs) {
      if (s.q_len <= 0) continue;
      PrefillSeq b = s;
      b.q_start = static_cast<int32_t>(s.q_start + total_q);
      b.kv_start = static_cast<int32_t>(s.kv_start + idx);
      b.layer = t.layer;
      if (b.sink_index >= 0 && t.sinks != nullptr) {
        if (sink_set < 0) {
          sink_set = static_cast<int32_t>(sinks_.size() / geo_.num_qo_heads);
          sinks_.insert(sinks_.end(), t.sinks, t.sinks + geo_.num_qo_heads);
        }
        b.sink_index = sink_set;
      } else {
        b.sink_index = -1;
      }
      out->any_soft_cap |= b.soft_cap != 0.f;
      seqs_.push_back(b);
    }
    total_q += t.total_q;
    idx += t.num_kv_indices;
    total_append += t.num_append;
  }
  if (total_q > limits_.max_rows || total_q > INT32_MAX || idx > limits_.max_indices ||
      total_append > limits_.max_append) {
    return absl::InternalError(absl::StrCat("batch of ", total_q, " rows, ", idx, " kv indices and ",
                                            total_append, " appended rows exceeds the CUDA staging (",
                                            limits_.max_rows, ", ", limits_.max_indices, ", ",
                                            limits_.max_append, ")"));
  }
  out->total_q = total_q;
  out->num_seqs = static_cast<int32_t>(seqs_.size());
  out->num_sink_sets = static_cast<int32_t>(sinks_.size() / geo_.num_qo_heads);
  *total_idx = idx;
  return absl::OkStatus();
}

absl::Status BatchPacker::PlanDecode(const std::vector<PrefillSeq>& seqs, PackedBatch* out) {
  const int32_t n = static_cast<int32_t>(seqs.size());
  const int32_t group = geo_.num_qo_heads / geo_.num_kv_heads;
  int32_t max_rows = 1;
  for (const PrefillSeq& s : seqs) {
    if (DecodeSeqQualifies(s, geo_)) max_rows = std::max(max_rows, s.q_len * group);
  }
  const int32_t tile_rows = DecodeTileRows(geo_.head_dim, max_rows);
  DecodePlanOptions dopt;
  dopt.num_sms = limits_.num_sms;
  dopt.ctas_per_sm = limits_.decode_ctas_per_sm[tile_rows == 32 ? 1 : 0];
  dopt.wide_ctas_per_sm = limits_.decode_wide_ctas_per_sm[tile_rows == 32 ? 1 : 0];
  dopt.max_partial_slots = std::max<int64_t>(DecodePartialSlots(limits_, geo_.head_dim), 1);
  dopt.max_cluster = limits_.decode_max_cluster[tile_rows == 32 ? 1 : 0];
  dopt.max_items = limits_.max_decode_items;
  BuildDecodePlan(seqs.data(), n, geo_, dopt, &decode_plan_);
  const int64_t items = static_cast<int64_t>(decode_plan_.items.size());
  if (items > limits_.max_decode_items || decode_plan_.partial_slots > dopt.max_partial_slots) {
    return absl::InternalError(absl::StrCat("decode plan has ", items, " work items and ",
                                            decode_plan_.partial_slots, " partial slots; workspace holds ",
                                            limits_.max_decode_items, " and ", dopt.max_partial_slots));
  }
  out->num_decode_seqs = decode_plan_.num_seqs_planned;
  out->num_decode_items = static_cast<int32_t>(items);
  out->decode_tile_rows = decode_plan_.tile_rows;
  out->decode_split_tiles = decode_plan_.split_tiles;
  out->decode_cluster = decode_plan_.cluster;
  return absl::OkStatus();
}

absl::Status BatchPacker::PlanMla(PackedBatch* out) {
  BuildMlaPlan(seqs_.data(), static_cast<int32_t>(seqs_.size()), geo_, limits_.mla, &mla_plan_);
  const int64_t items = static_cast<int64_t>(mla_plan_.items.size());
  const int64_t pairs = int64_t{mla_plan_.partial_slots} * mla_plan_.tile_rows;
  if (items > limits_.max_items || pairs > limits_.max_partial_pairs ||
      static_cast<int64_t>(mla_plan_.merges.size()) > MlaMaxMerges(limits_.mla)) {
    return absl::InternalError(absl::StrCat("MLA plan has ", items, " work items, ", mla_plan_.merges.size(),
                                            " merges and ", pairs, " partial rows; workspace holds ",
                                            limits_.max_items, ", ", MlaMaxMerges(limits_.mla), " and ",
                                            limits_.max_partial_pairs));
  }
  out->mla = true;
  out->mla_tile_rows = mla_plan_.tile_rows;
  out->mla_key_block = mla_plan_.key_block;
  out->num_items = static_cast<int32_t>(items);
  out->num_merges = static_cast<int32_t>(mla_plan_.merges.size());
  return absl::OkStatus();
}

absl::Status BatchPacker::Plan(PackedBatch* out) {
  decode_plan_.items.clear();
  mla_plan_.items.clear();
  mla_plan_.merges.clear();
  int32_t num_decode = 0;
  const int32_t n = static_cast<int32_t>(seqs_.size());
  plan_.items.clear();
  plan_.merges.clear();
  plan_.merge_pairs = 0;
  if (geo_.IsMla()) return PlanMla(out);
  if (limits_.decode && DecodeGeometrySupported(geo_)) {
    num_decode = SeqsForPrefillFamily(seqs_.data(), n, geo_, &prefill_seqs_);
  }
  if (num_decode > 0) {
    if (absl::Status st = PlanDecode(seqs_, out); !st.ok()) return st;
  }
  // The prefill family plans the rest (decode sequences have q_len 0 in the
  // copy: no items; its items index the same device seqs array).
  const std::vector<PrefillSeq>& rest = num_decode > 0 ? prefill_seqs_ : seqs_;
  if (num_decode < n) {
    const int64_t group = geo_.num_qo_heads / geo_.num_kv_heads;
    int64_t max_packed_rows = 0;
    for (const PrefillSeq& s : rest) max_packed_rows = std::max<int64_t>(max_packed_rows, s.q_len * group);
    out->mean_kv_per_row = MeanKvPerRow(rest.data(), n);
    out->kernel = ChoosePrefillKernel(geo_, limits_.device, max_packed_rows, limits_.family, out->mean_kv_per_row);
    PrefillPlanOptions popt;
    popt.num_sms = limits_.num_sms;
    popt.ctas_per_sm = limits_.ctas_per_sm[static_cast<int>(out->kernel)];
    popt.min_chunk = kMinChunk;
    popt.max_partial_pairs = limits_.max_partial_pairs;
    popt.tile_rows = PrefillTileRows(out->kernel, geo_.head_dim);
    popt.persistent_ctas = PrefillPersistentCtas(out->kernel, popt.num_sms, popt.ctas_per_sm);
    popt.max_items = limits_.max_items;
    BuildPrefillPlan(rest.data(), n, geo_, popt, &plan_);
  }
  if (static_cast<int64_t>(plan_.items.size()) > limits_.max_items) {
    return absl::InternalError(
        absl::StrCat("plan has ", plan_.items.size(), " work items; workspace holds ", limits_.max_items));
  }
  out->num_items = static_cast<int32_t>(plan_.items.size());
  out->num_merges = static_cast<int32_t>(plan_.merges.size());
  out->merge_pairs = plan_.merge_pairs;
  return absl::OkStatus();
}

int64_t BatchPacker::DedupAppends(absl::Span<const PrefillTask> tasks) {
  append_rows_.clear();
  append_slots_.clear();
  last_append_.clear();
  for (int32_t ti = 0; ti < static_cast<int32_t>(tasks.size()); ++ti) {
    const PrefillTask& t = tasks[ti];
    for (int64_t r = 0; r < t.num_append; ++r) {
      const int64_t kv_slot = int64_t{t.layer} * geo_.SlotsPerLayer() + t.append_slots[r];
      auto [pos, inserted] = last_append_.try_emplace(kv_slot, static_cast<int64_t>(append_rows_.size()));
      if (inserted) {
        append_rows_.push_back({ti, r});
        append_slots_.push_back(kv_slot);
      } else {
        append_rows_[pos->second] = {ti, r};
      }
    }
  }
  // The FP8 rows last, each group in its order (a stable partition of rows
  // and slots together).
  int64_t n_fp8 = 0;
  for (const auto& [task, row] : append_rows_) n_fp8 += tasks[task].append_fp8 ? 1 : 0;
  if (n_fp8 == 0 || n_fp8 == static_cast<int64_t>(append_rows_.size())) return n_fp8;
  std::vector<std::pair<int32_t, int64_t>> rows;
  std::vector<int64_t> slots;
  rows.reserve(append_rows_.size());
  slots.reserve(append_slots_.size());
  for (bool fp8 : {false, true}) {
    for (size_t i = 0; i < append_rows_.size(); ++i) {
      if (tasks[append_rows_[i].first].append_fp8 != fp8) continue;
      rows.push_back(append_rows_[i]);
      slots.push_back(append_slots_[i]);
    }
  }
  append_rows_.swap(rows);
  append_slots_.swap(slots);
  return n_fp8;
}

absl::Status BatchPacker::Pack(absl::Span<const PrefillTask> tasks, uint8_t* staging, int64_t in_capacity,
                               PackedBatch* out) {
  *out = PackedBatch();
  int64_t total_idx = 0;
  if (absl::Status st = Flatten(tasks, out, &total_idx); !st.ok()) return st;
  if (absl::Status st = Plan(out); !st.ok()) return st;
  const int64_t n_fp8 = DedupAppends(tasks);
  const int64_t n_append = static_cast<int64_t>(append_slots_.size());
  const int64_t n_half = n_append - n_fp8;
  out->num_append = n_append;
  out->num_append_fp8 = n_fp8;

  const int64_t q_row = geo_.QRowElems() * geo_.QElemBytes();
  const int64_t o_row = geo_.ORowElems() * geo_.QElemBytes();
  const int64_t kv_row = geo_.RowElems() * geo_.QElemBytes();  // geo.dtype rows
  const int64_t kv_row8 = geo_.RowElems();                     // FP8 rows
  const int64_t pools = geo_.NumPools();                       // no V rows without a V pool
  // The work items and merges of the family that runs: the prefill
  // family's, or the MLA family's.
  const void* items = out->mla ? static_cast<const void*>(mla_plan_.items.data()) : plan_.items.data();
  const int64_t items_bytes = out->mla ? int64_t{out->num_items} * int64_t{sizeof(MlaWorkItem)}
                                       : int64_t{out->num_items} * int64_t{sizeof(PrefillWorkItem)};
  const void* merges = out->mla ? static_cast<const void*>(mla_plan_.merges.data()) : plan_.merges.data();
  const int64_t merges_bytes = out->mla ? int64_t{out->num_merges} * int64_t{sizeof(MlaMergeTile)}
                                        : int64_t{out->num_merges} * int64_t{sizeof(SplitMergeSeq)};
  StagingPacker in(staging, in_capacity);
  out->off_q = in.Take(out->total_q * q_row);
  out->off_idx = in.Take(total_idx * 4);
  out->off_seqs = in.Take(static_cast<int64_t>(seqs_.size() * sizeof(PrefillSeq)));
  out->off_sinks = in.Take(static_cast<int64_t>(sinks_.size() * sizeof(float)));
  out->off_items = in.Take(items_bytes);
  out->off_merges = in.Take(merges_bytes);
  out->off_decode_items = in.Take(int64_t{out->num_decode_items} * int64_t{sizeof(DecodeWorkItem)});
  out->off_slots = in.Take(n_append * 8);
  out->off_k = in.Take(n_half * kv_row);
  out->off_v = in.Take((pools - 1) * n_half * kv_row);
  out->off_k8 = in.Take(n_fp8 * kv_row8);
  out->off_v8 = in.Take((pools - 1) * n_fp8 * kv_row8);
  for (int64_t off : {out->off_q, out->off_idx, out->off_seqs, out->off_sinks, out->off_items, out->off_merges,
                      out->off_decode_items, out->off_slots, out->off_k, out->off_v, out->off_k8,
                      out->off_v8}) {
    if (off < 0) return absl::InternalError("input staging overflow");
  }
  int64_t row = 0, idx = 0;
  bool q_all_direct = true;
  for (const PrefillTask& t : tasks) {
    if (t.total_q > 0 && (t.q_on_device || (t.q_pinned && int64_t{t.total_q} * q_row >= kMinDirectCopyBytes))) {
      AddDeviceCopy(&out->device_in, out->off_q + row * q_row, t.q, int64_t{t.total_q} * q_row);
    } else if (t.total_q > 0) {
      // Inline queries that arrived in pieces are gathered here: this is
      // their one host copy, as it is a contiguous one's.
      if (!t.q_scattered.empty()) {
        CopyOut(t.q_scattered, 0, int64_t{t.total_q} * q_row, in.At(out->off_q) + row * q_row);
      } else {
        CopyBytes(in.At(out->off_q) + row * q_row, t.q, int64_t{t.total_q} * q_row);
      }
      q_all_direct = false;
    }
    if (t.num_kv_indices > 0) std::memcpy(in.At(out->off_idx) + idx * 4, t.kv_indices, size_t(t.num_kv_indices) * 4);
    row += t.total_q;
    idx += t.num_kv_indices;
  }
  if (!seqs_.empty()) std::memcpy(in.At(out->off_seqs), seqs_.data(), seqs_.size() * sizeof(PrefillSeq));
  if (!sinks_.empty()) std::memcpy(in.At(out->off_sinks), sinks_.data(), sinks_.size() * sizeof(float));
  if (items_bytes > 0) std::memcpy(in.At(out->off_items), items, size_t(items_bytes));
  if (merges_bytes > 0) std::memcpy(in.At(out->off_merges), merges, size_t(merges_bytes));
  if (out->num_decode_items > 0) {
    std::memcpy(in.At(out->off_decode_items), decode_plan_.items.data(),
                decode_plan_.items.size() * sizeof(DecodeWorkItem));
  }
  bool kv_all_direct = true;
  if (n_append > 0) {
    std::memcpy(in.At(out->off_slots), append_slots_.data(), n_append * 8);
    // K rows, then V rows (of the geo.dtype rows, then of the FP8 ones), so
    // that consecutive device rows coalesce. Kept rows are copied in runs:
    // consecutive rows of one task (all of them, unless a later write to the
    // same slot dropped some).
    for (int section = 0; section < 4; ++section) {
      const bool fp8 = section >= 2;
      const bool is_k = section % 2 == 0;
      if (!is_k && pools == 1) continue;  // MLA: V is in K's rows
      const int64_t off = fp8 ? (is_k ? out->off_k8 : out->off_v8) : (is_k ? out->off_k : out->off_v);
      const int64_t row_bytes = fp8 ? kv_row8 : kv_row;
      const int64_t begin = fp8 ? n_half : 0;
      const int64_t end = fp8 ? n_append : n_half;
      for (int64_t i = begin; i < end;) {
        const auto [task, first] = append_rows_[i];
        int64_t run = 1;
        while (i + run < end && append_rows_[i + run].first == task &&
               append_rows_[i + run].second == first + run) {
          ++run;
        }
        const PrefillTask& t = tasks[task];
        const ScatterList& scattered = is_k ? t.append_k_scattered : t.append_v_scattered;
        const auto* base = static_cast<const uint8_t*>(is_k ? t.append_k : t.append_v);
        const bool pinned = (is_k ? t.append_k_pinned : t.append_v_pinned) &&
                            t.num_append * row_bytes >= kMinDirectCopyBytes;
        uint8_t* const dst = in.At(off) + (i - begin) * row_bytes;
        if (!scattered.empty()) {  // inline, in pieces (base is null)
          CopyOut(scattered, first * row_bytes, run * row_bytes, dst);
          kv_all_direct = false;
        } else if ((is_k ? t.append_k_on_device : t.append_v_on_device) || pinned) {
          AddDeviceCopy(&out->device_in, off + (i - begin) * row_bytes, base + first * row_bytes,
                        run * row_bytes);
        } else {
          CopyBytes(dst, base + first * row_bytes, run * row_bytes);
          kv_all_direct = false;
        }
        i += run;
      }
    }
  }
  out->in_bytes = in.used();
  out->upload_begin = q_all_direct ? out->off_idx : 0;
  out->upload_end = n_append > 0 && kv_all_direct ? out->off_k : out->in_bytes;
  out->off_lse = AlignUp(out->total_q * o_row);
  out->out_bytes = out->off_lse + out->total_q * geo_.num_qo_heads * 4;
  return absl::OkStatus();
}

}  // namespace attnserve
