// SequenceModel: the K/V the test believes each sequence has, by sequence
// and position, and the float64 reference (common/reference.h) of a step's
// attention over it, checked sequence by sequence. The fault-injection tests
// of KvManager and Cluster compare every Run() that returns OK with it: a
// manager that attends over pages now holding another sequence's KV (or
// over rows never written) fails the check, whatever pages it used.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "client/workload.h"
#include "common/kv_geometry.h"

namespace attnserve {

class SequenceModel {
 public:
  explicit SequenceModel(const KvGeometry& geo) : geo_(geo) {}

  // Writes rows [start, start + n) of `layer` of a sequence (k, v: (n,
  // kv_heads, head_dim)); a rewrite of rows it has replaces them.
  void Write(int64_t seq, int32_t layer, int64_t start, absl::Span<const uint16_t> k,
             absl::Span<const uint16_t> v);
  // Rows the model has of a sequence's layer (0 when unknown).
  int64_t Rows(int64_t seq, int32_t layer) const;
  void Erase(int64_t seq) { rows_.erase(seq); }
  void Clear() { rows_.clear(); }

  // One sequence of a step's output: its query rows are the last q_len
  // positions of its kv_len (bottom-right causal), at rows [row, row +
  // q_len) of q, o and lse.
  struct Part {
    int64_t seq = 0;
    int64_t row = 0;
    int64_t q_len = 0;
    int64_t kv_len = 0;
  };
  // The comparison of each part's rows (o (total_q, qo_heads, head_dim),
  // lse (total_q, qo_heads)) with the reference over the model's rows;
  // returns the parts that differ, with what was found. A part whose
  // kv_len the model does not have fails too.
  std::vector<std::pair<int64_t, std::string>> Check(int32_t layer, absl::Span<const Part> parts,
                                                     absl::Span<const uint16_t> q,
                                                     absl::Span<const uint16_t> o,
                                                     absl::Span<const float> lse) const;

 private:
  struct Layers {
    std::vector<std::vector<uint16_t>> k, v;  // [layer] (rows, kv_heads, head_dim)
  };
  KvGeometry geo_;
  absl::flat_hash_map<int64_t, Layers> rows_;
};

}  // namespace attnserve
