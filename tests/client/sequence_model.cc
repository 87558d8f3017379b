#include "tests/client/sequence_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/reference.h"

namespace attnserve {
namespace {

// One sequence's rows of one layer as the reference reads them: slot j is
// position j (page_size 1).
class SequenceRows final : public reference::KvRows {
 public:
  SequenceRows(const uint16_t* k, const uint16_t* v, int64_t row_elems)
      : k_(k), v_(v), row_elems_(row_elems) {}
  const void* K(int32_t, int64_t slot) const override { return k_ + slot * row_elems_; }
  const void* V(int32_t, int64_t slot) const override { return v_ + slot * row_elems_; }

 private:
  const uint16_t* k_;
  const uint16_t* v_;
  int64_t row_elems_;
};

}  // namespace

void SequenceModel::Write(int64_t seq, int32_t layer, int64_t start, absl::Span<const uint16_t> k,
                          absl::Span<const uint16_t> v) {
  Layers& l = rows_[seq];
  if (l.k.empty()) {
    l.k.resize(geo_.num_layers);
    l.v.resize(geo_.num_layers);
  }
  const size_t at = static_cast<size_t>(start * geo_.RowElems());
  if (l.k[layer].size() < at + k.size()) {
    l.k[layer].resize(at + k.size());
    l.v[layer].resize(at + v.size());
  }
  std::copy(k.begin(), k.end(), l.k[layer].begin() + at);
  std::copy(v.begin(), v.end(), l.v[layer].begin() + at);
}

int64_t SequenceModel::Rows(int64_t seq, int32_t layer) const {
  auto it = rows_.find(seq);
  if (it == rows_.end() || it->second.k.empty()) return 0;
  return static_cast<int64_t>(it->second.k[layer].size()) / geo_.RowElems();
}

std::vector<std::pair<int64_t, std::string>> SequenceModel::Check(
    int32_t layer, absl::Span<const Part> parts, absl::Span<const uint16_t> q,
    absl::Span<const uint16_t> o, absl::Span<const float> lse) const {
  std::vector<std::pair<int64_t, std::string>> wrong;
  KvGeometry g = geo_;
  g.page_size = 1;
  const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim;
  for (const Part& p : parts) {
    if (Rows(p.seq, layer) < p.kv_len) {
      wrong.push_back({p.seq, absl::StrCat("the model has ", Rows(p.seq, layer), " rows of layer ",
                                           layer, ", the step attends over ", p.kv_len)});
      continue;
    }
    const Layers& l = rows_.at(p.seq);
    SequenceRows rows(l.k[layer].data(), l.v[layer].data(), g.RowElems());
    std::vector<int32_t> kv_indices(p.kv_len);
    for (int64_t j = 0; j < p.kv_len; ++j) kv_indices[j] = static_cast<int32_t>(j);
    reference::Seq s;
    s.q_start = 0;
    s.q_len = p.q_len;
    s.kv_start = 0;
    s.kv_len = p.kv_len;
    s.layer = layer;
    s.sm_scale = 1.0 / std::sqrt(static_cast<double>(g.head_dim));
    s.causal = true;
    std::vector<double> o_ref(p.q_len * q_row), lse_ref(p.q_len * g.num_qo_heads);
    reference::Prefill(g, rows, q.data() + p.row * q_row, p.q_len, kv_indices, {s}, &o_ref,
                       &lse_ref);
    const Comparison c = Compare(g.dtype, o_ref, lse_ref, o.subspan(p.row * q_row, p.q_len * q_row),
                                 lse.subspan(p.row * g.num_qo_heads, p.q_len * g.num_qo_heads));
    if (!c.Ok(g.dtype)) wrong.push_back({p.seq, c.ToString()});
  }
  return wrong;
}

}  // namespace attnserve
