// The Client's RPCs that carry tensors: WriteKV and ReadKV (inline, FP8,
// through regions), Prefill and its plans (CreatePlan, ReleasePlan) and
// MergeStates, with the wire helpers that encode their tensors without
// copying them (client.cc has the connection, pages, scales, regions,
// leases and health).
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/raw_methods.h"
#include "common/tensor_wire.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/impl/client_unary_call.h"

namespace attnserve {
namespace {

// The dtype of queries, outputs, states and 16-bit K/V rows.
v1::DType WireDType(const v1::ServerInfo& info) { return QueryDType(info); }

void SetOptions(const AttentionOptions& o, v1::AttentionOptions* out) {
  if (o.window_left) out->set_window_left(*o.window_left);
  if (o.logits_soft_cap) out->set_logits_soft_cap(*o.logits_soft_cap);
  out->mutable_sinks()->Assign(o.sinks.begin(), o.sinks.end());
}

void SetRef(v1::RegionRef* r, const RegionRef& ref) {
  r->set_name(ref.name);
  r->set_offset(ref.offset);
  r->set_byte_size(ref.byte_size);
}

void SetRegionTensor(v1::Tensor* t, v1::DType dtype, std::initializer_list<int64_t> shape,
                     const RegionRef& ref) {
  t->set_dtype(dtype);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
  SetRef(t->mutable_region(), ref);
}

// Tensors from this size on are sent from the caller's memory (borrowed
// until gRPC has written them); smaller ones are copied into the request,
// which costs less than a slice of their own.
constexpr size_t kBorrowMinBytes = 16 << 10;

// A request tensor that travels inline: field number, dtype, shape
// (row-major) and the caller's bytes.
struct InlineTensor {
  uint32_t field;
  v1::DType dtype;
  std::vector<int64_t> shape;
  const void* data;
  size_t bytes;
};

void AppendInline(const InlineTensor& t, WireWriter* w, BorrowedMemory* borrowed) {
  if (t.bytes >= kBorrowMinBytes) {
    w->AppendTensor(t.field, t.dtype, t.shape, borrowed->Borrow(t.data, t.bytes), t.bytes);
  } else {
    w->AppendTensorCopy(t.field, t.dtype, t.shape, t.data, t.bytes);
  }
}

// A request's wire bytes: `small` (every field but the inline tensors)
// serialized, then the inline tensors, whose data is not copied.
grpc::ByteBuffer EncodeRequest(const google::protobuf::MessageLite& small,
                               absl::Span<const InlineTensor> tensors, BorrowedMemory* borrowed) {
  WireWriter w;
  w.AppendCopy(small.SerializeAsString());
  for (const InlineTensor& t : tensors) AppendInline(t, &w, borrowed);
  return w.Finish();
}

// Where a response tensor's data goes: straight into `out` (one copy from
// gRPC's slices). A size that is not whole elements does not parse.
template <typename T>
TensorSink Into(std::vector<T>* out) {
  return [out](size_t bytes) -> void* {
    if (bytes % sizeof(T) != 0) return nullptr;
    out->resize(bytes / sizeof(T));
    return out->data();
  };
}

}  // namespace

absl::Status Client::WriteKV(int32_t layer, absl::Span<const int64_t> slots,
                             absl::Span<const uint16_t> k, absl::Span<const uint16_t> v) {
  return WriteKvInline(layer, slots, WireDType(info_), k.data(), k.size() * sizeof(uint16_t),
                       v.data(), v.size() * sizeof(uint16_t));
}

absl::Status Client::WriteKVFp8(int32_t layer, absl::Span<const int64_t> slots,
                                absl::Span<const uint8_t> k, absl::Span<const uint8_t> v) {
  const v1::DType dtype =
      info_.kv_dtype() == v1::DTYPE_FP8_E5M2 ? v1::DTYPE_FP8_E5M2 : v1::DTYPE_FP8_E4M3;
  return WriteKvInline(layer, slots, dtype, k.data(), k.size(), v.data(), v.size());
}

absl::Status Client::WriteKvInline(int32_t layer, absl::Span<const int64_t> slots,
                                   v1::DType dtype, const void* k, size_t k_bytes,
                                   const void* v, size_t v_bytes) {
  v1::WriteKVRequest req;  // k and v follow inline
  req.set_layer(layer);
  req.mutable_slots()->Assign(slots.begin(), slots.end());
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  req.set_lease_id(lease_id());
  const int64_t n = static_cast<int64_t>(slots.size());
  const std::vector<int64_t> shape = {n, info_.num_kv_heads(), info_.head_dim()};
  const InlineTensor tensors[] = {{3, dtype, shape, k, k_bytes}, {4, dtype, shape, v, v_bytes}};
  // An MLA server's rows are k alone: an empty v is not sent.
  const size_t count = SendsV(v_bytes) ? 2 : 1;
  BorrowedMemory borrowed;
  grpc::ByteBuffer bytes;
  grpc::Status s = CallRaw(raw_->write_kv,
                           EncodeRequest(req, absl::MakeConstSpan(tensors, count), &borrowed),
                           &bytes);
  borrowed.WaitReleased();
  if (!s.ok()) return FromGrpc(s);
  v1::WriteKVResponse resp;
  if (!grpc::SerializationTraits<v1::WriteKVResponse>::Deserialize(&bytes, &resp).ok()) {
    return absl::InternalError("response does not parse as attnserve.v1.WriteKVResponse");
  }
  Learn(resp.incarnation());
  return absl::OkStatus();
}

absl::StatusOr<KvData> Client::ReadKV(int32_t layer, absl::Span<const int64_t> slots,
                                      bool dequantize) {
  v1::ReadKVRequest req;
  req.set_layer(layer);
  req.mutable_slots()->Assign(slots.begin(), slots.end());
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  req.set_lease_id(lease_id());
  req.set_dequantize(dequantize);
  grpc::ByteBuffer bytes;
  grpc::Status s = CallRaw(raw_->read_kv, EncodeRequest(req, {}, nullptr), &bytes);
  if (!s.ok()) return FromGrpc(s);
  KvData out;
  ReceivedTensor k, v;
  uint64_t seen = 0;
  // An FP8 server answers its stored bytes unless asked to dequantize.
  const bool fp8 = GeometryOf(info_).KvIsFp8() && !dequantize;
  absl::Status parsed =
      fp8 ? ReadTensorResponse(bytes, "attnserve.v1.ReadKVResponse", &k, Into(&out.k_fp8), &v,
                               Into(&out.v_fp8), &seen)
          : ReadTensorResponse(bytes, "attnserve.v1.ReadKVResponse", &k, Into(&out.k), &v,
                               Into(&out.v), &seen);
  if (!parsed.ok()) return absl::InternalError(parsed.message());
  const v1::DType want = fp8 ? info_.kv_dtype() : WireDType(info_);
  if ((k.present && k.dtype != want) || (v.present && v.dtype != want)) {
    return absl::InternalError(absl::StrCat("ReadKV answered rows of dtype ", k.dtype,
                                            ", this client expected ", v1::DType_Name(want)));
  }
  Learn(seen);
  return out;
}

absl::StatusOr<PrefillResult> Client::Prefill(const PrefillArgs& args) {
  PrefillResult result;
  absl::Status s = PrefillInto(args, &result);
  if (!s.ok()) return s;
  return result;
}

grpc::ByteBuffer Client::EncodePrefill(const PrefillArgs& a, BorrowedMemory* borrowed) const {
  v1::PrefillRequest req;  // inline tensors follow it
  std::vector<InlineTensor> tensors;
  req.set_layer(a.layer);
  const int64_t row = int64_t{info_.num_qo_heads()} * info_.head_dim();
  if (a.q_region) {
    SetRegionTensor(req.mutable_q(), WireDType(info_),
                    {a.q_rows, info_.num_qo_heads(), info_.head_dim()}, *a.q_region);
  } else {
    const int64_t total_q = row == 0 ? 0 : static_cast<int64_t>(a.q.size()) / row;
    tensors.push_back({2, WireDType(info_), {total_q, info_.num_qo_heads(), info_.head_dim()},
                       a.q.data(), a.q.size() * sizeof(uint16_t)});
  }
  req.mutable_qo_indptr()->Assign(a.qo_indptr.begin(), a.qo_indptr.end());
  req.mutable_kv_indptr()->Assign(a.kv_indptr.begin(), a.kv_indptr.end());
  req.mutable_kv_indices()->Assign(a.kv_indices.begin(), a.kv_indices.end());
  req.mutable_kv_last_page_len()->Assign(a.kv_last_page_len.begin(), a.kv_last_page_len.end());
  if (a.sm_scale) req.set_sm_scale(*a.sm_scale);
  if (a.causal) req.set_causal(*a.causal);
  req.set_lse_base(a.lse_base_e ? v1::LSE_BASE_E : v1::LSE_BASE_2);
  const bool append_in_region = a.append_k_region || a.append_v_region;
  const bool append_fp8 = !a.append_k_fp8.empty() || !a.append_v_fp8.empty();
  if (!append_in_region && append_fp8) {
    // Rows as an FP8 server stores them.
    const int64_t row = int64_t{info_.num_kv_heads()} * info_.head_dim();
    const int64_t n = !a.append_slots.empty() ? static_cast<int64_t>(a.append_slots.size())
                      : row == 0             ? 0
                                             : static_cast<int64_t>(a.append_k_fp8.size()) / row;
    req.mutable_append_slots()->Assign(a.append_slots.begin(), a.append_slots.end());
    tensors.push_back({11, info_.kv_dtype(), {n, info_.num_kv_heads(), info_.head_dim()},
                       a.append_k_fp8.data(), a.append_k_fp8.size()});
    if (SendsV(a.append_v_fp8.size())) {
      tensors.push_back({12, info_.kv_dtype(), {n, info_.num_kv_heads(), info_.head_dim()},
                         a.append_v_fp8.data(), a.append_v_fp8.size()});
    }
  } else if (!append_in_region && (!a.append_slots.empty() || !a.append_k.empty())) {
    // With a plan the slots are the plan's: the rows come from append_k.
    const int64_t row = int64_t{info_.num_kv_heads()} * info_.head_dim();
    const int64_t n = !a.append_slots.empty() ? static_cast<int64_t>(a.append_slots.size())
                      : row == 0             ? 0
                                             : static_cast<int64_t>(a.append_k.size()) / row;
    req.mutable_append_slots()->Assign(a.append_slots.begin(), a.append_slots.end());
    tensors.push_back({11, WireDType(info_), {n, info_.num_kv_heads(), info_.head_dim()},
                       a.append_k.data(), a.append_k.size() * sizeof(uint16_t)});
    if (SendsV(a.append_v.size())) {
      tensors.push_back({12, WireDType(info_), {n, info_.num_kv_heads(), info_.head_dim()},
                         a.append_v.data(), a.append_v.size() * sizeof(uint16_t)});
    }
  } else if (append_in_region) {
    const int64_t n = !a.append_slots.empty() ? static_cast<int64_t>(a.append_slots.size())
                                              : a.append_rows;
    req.mutable_append_slots()->Assign(a.append_slots.begin(), a.append_slots.end());
    if (a.append_k_region) {
      SetRegionTensor(req.mutable_append_k(), WireDType(info_),
                      {n, info_.num_kv_heads(), info_.head_dim()}, *a.append_k_region);
    }
    if (a.append_v_region) {
      SetRegionTensor(req.mutable_append_v(), WireDType(info_),
                      {n, info_.num_kv_heads(), info_.head_dim()}, *a.append_v_region);
    }
  }
  if (a.output_region) SetRef(req.mutable_output_region(), *a.output_region);
  if (a.lse_region) SetRef(req.mutable_lse_region(), *a.lse_region);
  req.set_expected_incarnation(a.expected_incarnation != 0 ? a.expected_incarnation
                                                           : incarnation());
  req.set_lease_id(a.lease_id != 0 ? a.lease_id : lease_id());
  req.set_plan_id(a.plan_id);
  req.mutable_kv_keys_after()->Assign(a.kv_keys_after.begin(), a.kv_keys_after.end());
  if (!a.options.empty()) SetOptions(a.options, req.mutable_options());
  req.mutable_apply_sinks()->Assign(a.apply_sinks.begin(), a.apply_sinks.end());
  return EncodeRequest(req, tensors, borrowed);
}

absl::Status Client::DecodePrefill(const grpc::ByteBuffer& bytes, PrefillResult* result) {
  ReceivedTensor o, lse;
  absl::Status parsed =
      ReadTensorResponse(bytes, "attnserve.v1.PrefillResponse", &o, Into(&result->o), &lse,
                         Into(&result->lse), &result->incarnation);
  if (!parsed.ok()) return absl::InternalError(parsed.message());
  if (o.bytes == 0) result->o.clear();  // no data field: nothing was written into it
  if (lse.bytes == 0) result->lse.clear();
  Learn(result->incarnation);
  return absl::OkStatus();
}

absl::Status Client::PrefillInto(const PrefillArgs& a, PrefillResult* result) {
  if (a.expected_incarnation == 0) {
    if (absl::Status g = CheckGeometryAfterForget(); !g.ok()) return g;
  }
  BorrowedMemory borrowed;
  grpc::ByteBuffer bytes;
  grpc::Status s = CallRaw(raw_->prefill, EncodePrefill(a, &borrowed), &bytes);
  borrowed.WaitReleased();
  if (!s.ok()) return FromGrpc(s);
  return DecodePrefill(bytes, result);
}

absl::StatusOr<uint64_t> Client::CreatePlan(const PlanLayout& layout) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::CreatePlanRequest req;
  req.mutable_qo_indptr()->Assign(layout.qo_indptr.begin(), layout.qo_indptr.end());
  req.mutable_kv_indptr()->Assign(layout.kv_indptr.begin(), layout.kv_indptr.end());
  req.mutable_kv_indices()->Assign(layout.kv_indices.begin(), layout.kv_indices.end());
  req.mutable_kv_last_page_len()->Assign(layout.kv_last_page_len.begin(),
                                         layout.kv_last_page_len.end());
  req.mutable_append_slots()->Assign(layout.append_slots.begin(), layout.append_slots.end());
  req.mutable_kv_keys_after()->Assign(layout.kv_keys_after.begin(), layout.kv_keys_after.end());
  req.mutable_apply_sinks()->Assign(layout.apply_sinks.begin(), layout.apply_sinks.end());
  if (!layout.options.empty()) SetOptions(layout.options, req.mutable_options());
  for (const auto& [layer, options] : layout.layer_options) {
    SetOptions(options, &(*req.mutable_layer_options())[layer]);
  }
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  req.set_lease_id(lease_id());
  v1::CreatePlanResponse resp;
  grpc::Status s = stub_->CreatePlan(&ctx, req, &resp);
  if (!s.ok()) return FromGrpc(s);
  Learn(resp.incarnation());
  return resp.plan_id();
}

absl::Status Client::ReleasePlan(uint64_t plan_id) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ReleasePlanRequest req;
  req.set_plan_id(plan_id);
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  req.set_lease_id(lease_id());
  v1::ReleasePlanResponse resp;
  return FromGrpc(stub_->ReleasePlan(&ctx, req, &resp));
}

absl::StatusOr<State> Client::MergeStates(absl::Span<const State> states, int64_t n, int32_t h,
                                          int32_t d, bool lse_base_e) {
  v1::MergeStatesRequest req;  // the states follow it
  req.set_lse_base(lse_base_e ? v1::LSE_BASE_E : v1::LSE_BASE_2);
  BorrowedMemory borrowed;
  WireWriter w;
  w.AppendCopy(req.SerializeAsString());
  const std::vector<int64_t> v_shape = {n, h, d};
  const std::vector<int64_t> lse_shape = {n, h};
  for (const State& st : states) {
    // AttentionState {Tensor v = 1; Tensor lse = 2;} as field 1.
    const InlineTensor v{1, WireDType(info_), v_shape, st.v.data(), st.v.size() * sizeof(uint16_t)};
    const InlineTensor lse{2, v1::DTYPE_FP32, lse_shape, st.lse.data(), st.lse.size() * 4};
    w.AppendLengthPrefix(1, TensorFieldSize(v.field, v.dtype, v.shape, v.bytes) +
                                TensorFieldSize(lse.field, lse.dtype, lse.shape, lse.bytes));
    AppendInline(v, &w, &borrowed);
    AppendInline(lse, &w, &borrowed);
  }
  grpc::ByteBuffer bytes;
  grpc::Status s = CallRaw(raw_->merge_states, w.Finish(), &bytes);
  borrowed.WaitReleased();
  if (!s.ok()) return FromGrpc(s);
  State out;
  ReceivedTensor v, lse;
  uint64_t seen = 0;
  absl::Status parsed = ReadTensorResponse(bytes, "attnserve.v1.MergeStatesResponse", &v,
                                           Into(&out.v), &lse, Into(&out.lse), &seen);
  if (!parsed.ok()) return absl::InternalError(parsed.message());
  // The caller indexes the result as (n, h, d) and (n, h): a response of
  // another size is the server's error, not an index out of range here.
  if (static_cast<int64_t>(out.v.size()) != n * h * d || static_cast<int64_t>(out.lse.size()) != n * h) {
    return absl::InternalError(absl::StrCat("MergeStates answered v of ", out.v.size(), " and lse of ",
                                            out.lse.size(), " values for ", n, " x ", h, " rows of ", d));
  }
  return out;
}

absl::Status Client::WriteKVFromRegions(int32_t layer, absl::Span<const int64_t> slots,
                                        const RegionRef& k, const RegionRef& v) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::WriteKVRequest req;
  req.set_layer(layer);
  req.mutable_slots()->Assign(slots.begin(), slots.end());
  const int64_t n = static_cast<int64_t>(slots.size());
  SetRegionTensor(req.mutable_k(), WireDType(info_), {n, info_.num_kv_heads(), info_.head_dim()},
                  k);
  if (SendsV(v.name.size())) {
    SetRegionTensor(req.mutable_v(), WireDType(info_),
                    {n, info_.num_kv_heads(), info_.head_dim()}, v);
  }
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  req.set_lease_id(lease_id());
  v1::WriteKVResponse resp;
  grpc::Status s = stub_->WriteKV(&ctx, req, &resp);
  if (s.ok()) Learn(resp.incarnation());
  return FromGrpc(s);
}

absl::Status Client::ReadKVToRegions(int32_t layer, absl::Span<const int64_t> slots,
                                     const RegionRef& k, const RegionRef& v) {
  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::ReadKVRequest req;
  req.set_layer(layer);
  req.mutable_slots()->Assign(slots.begin(), slots.end());
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  req.set_lease_id(lease_id());
  SetRef(req.mutable_k_region(), k);
  if (SendsV(v.name.size())) SetRef(req.mutable_v_region(), v);
  v1::ReadKVResponse resp;
  grpc::Status s = stub_->ReadKV(&ctx, req, &resp);
  if (s.ok()) Learn(resp.incarnation());
  return FromGrpc(s);
}

}  // namespace attnserve
