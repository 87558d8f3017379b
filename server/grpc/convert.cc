#include "server/grpc/convert.h"

#include <memory>

namespace attnserve {
namespace {

TensorView View(const v1::Tensor& t) {
  TensorView view;
  view.dtype = t.dtype();
  view.shape.assign(t.shape().begin(), t.shape().end());
  view.data = t.data();
  return view;
}

template <typename T>
absl::Span<const T> Span(const google::protobuf::RepeatedField<T>& field) {
  return absl::MakeConstSpan(field.data(), static_cast<size_t>(field.size()));
}

}  // namespace

void ToCall(const v1::PrefillRequest& r, v1::PrefillResponse* response, PrefillCall* c) {
  c->layer = r.layer();
  c->q = View(r.q());
  c->qo_indptr = Span(r.qo_indptr());
  c->kv_indptr = Span(r.kv_indptr());
  c->kv_indices = Span(r.kv_indices());
  c->kv_last_page_len = Span(r.kv_last_page_len());
  if (r.has_sm_scale()) c->sm_scale = r.sm_scale();
  if (r.has_causal()) c->causal = r.causal();
  c->lse_base = r.lse_base();
  c->append_slots = Span(r.append_slots());
  c->append_k = View(r.append_k());
  c->append_v = View(r.append_v());
  c->expected_incarnation = r.expected_incarnation();
  c->out_o = response->mutable_output()->mutable_data();
  c->out_lse = response->mutable_lse()->mutable_data();
}

void ToCall(const v1::WriteKVRequest& r, WriteKvCall* c) {
  c->layer = r.layer();
  c->slots = Span(r.slots());
  c->k = View(r.k());
  c->v = View(r.v());
}

void ToCall(const v1::ReadKVRequest& r, v1::ReadKVResponse* response, ReadKvCall* c) {
  c->layer = r.layer();
  c->slots = Span(r.slots());
  c->out_k = response->mutable_k()->mutable_data();
  c->out_v = response->mutable_v()->mutable_data();
}

void ToCall(const v1::MergeStatesRequest& r, v1::MergeStatesResponse* response,
            MergeStatesCall* c) {
  for (const auto& s : r.states()) {
    c->v.push_back(View(s.v()));
    c->lse.push_back(View(s.lse()));
  }
  c->lse_base = r.lse_base();
  c->out_v = response->mutable_v()->mutable_data();
  c->out_lse = response->mutable_lse()->mutable_data();
}

int64_t ResetForReuse(v1::PrefillRequest* request, v1::PrefillResponse* response) {
  request->Clear();
  std::unique_ptr<v1::Tensor> output(response->release_output());
  std::unique_ptr<v1::Tensor> lse(response->release_lse());
  response->Clear();
  int64_t kept = 0;
  for (v1::Tensor* t : {output.get(), lse.get()}) {
    if (t == nullptr) continue;
    t->Clear();  // keeps the data string's capacity
    kept += static_cast<int64_t>(t->data().capacity());
  }
  if (output != nullptr) response->set_allocated_output(output.release());
  if (lse != nullptr) response->set_allocated_lse(lse.release());
  return kept;
}

void SetTensorHeader(v1::Tensor* t, v1::DType dtype, absl::Span<const int64_t> shape) {
  t->set_dtype(dtype);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
}

}  // namespace attnserve
