#include "server/grpc/convert.h"

#include <atomic>
#include <climits>
#include <memory>
#include <string>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/slice.h"
#include "absl/strings/str_cat.h"
#include "common/tensor_wire.h"
#include "server/core/status_macros.h"

namespace attnserve {
namespace {

RegionRefView RefView(bool set, const v1::RegionRef& r) {
  RegionRefView view;
  view.set = set;
  if (set) {
    view.name = r.name();
    view.offset = r.offset();
    view.byte_size = r.byte_size();
  }
  return view;
}

TensorView View(const v1::Tensor& t) {
  TensorView view;
  view.dtype = FromProto(t.dtype());
  view.shape.assign(t.shape().begin(), t.shape().end());
  view.data = t.data();
  view.region = RefView(t.has_region(), t.region());
  return view;
}

template <typename T>
absl::Span<const T> Span(const google::protobuf::RepeatedField<T>& field) {
  return absl::MakeConstSpan(field.data(), static_cast<size_t>(field.size()));
}

}  // namespace

TensorDType FromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_UNSPECIFIED: return TensorDType::kUnspecified;
    case v1::DTYPE_BF16: return TensorDType::kBf16;
    case v1::DTYPE_FP16: return TensorDType::kFp16;
    case v1::DTYPE_FP32: return TensorDType::kFp32;
    default: return TensorDType::kUnknown;  // any other value a client may send
  }
}

v1::DType ToProto(KvDType dtype) {
  switch (dtype) {
    case KvDType::kBf16: return v1::DTYPE_BF16;
    case KvDType::kFp16: return v1::DTYPE_FP16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

void ToCall(const v1::PrefillRequest& r, PrefillCall* c) {
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
  c->kv_keys_after = Span(r.kv_keys_after());
  c->plan_id = r.plan_id();
  c->out_region = RefView(r.has_output_region(), r.output_region());
  c->lse_region = RefView(r.has_lse_region(), r.lse_region());
}

PrefillLayout ToLayout(const v1::CreatePlanRequest& r) {
  return PrefillLayout{Span(r.qo_indptr()),        Span(r.kv_indptr()),
                       Span(r.kv_indices()),       Span(r.kv_last_page_len()),
                       Span(r.append_slots()),     Span(r.kv_keys_after())};
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
  c->k_region = RefView(r.has_k_region(), r.k_region());
  c->v_region = RefView(r.has_v_region(), r.v_region());
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
  c->v_region = RefView(r.has_v_region(), r.v_region());
  c->lse_region = RefView(r.has_lse_region(), r.lse_region());
}

RegionSpec ToSpec(const v1::RegisterRegionRequest& r) {
  RegionSpec spec;
  spec.name = r.name();
  if (r.has_cuda()) {
    spec.kind = RegionKind::kCuda;
    spec.ipc_handle = r.cuda().ipc_handle();
    spec.device_id = r.cuda().device_id();
    spec.byte_size = r.cuda().byte_size();
  } else {
    spec.kind = RegionKind::kSystem;
    spec.key = r.system().key();
    spec.offset = r.system().offset();
    spec.byte_size = r.system().byte_size();
  }
  return spec;
}

void ToProto(const RegionInfoData& info, v1::RegionInfo* out) {
  out->set_name(info.name);
  out->set_kind(info.kind == RegionKind::kCuda ? "cuda" : "system");
  out->set_key(info.key);
  out->set_offset(info.offset);
  out->set_byte_size(info.byte_size);
  out->set_device_id(info.device_id);
  out->set_in_use(info.in_use);
  out->set_registered(info.registered);
  out->set_key_exists(info.key_exists);
}

int64_t ResetForReuse(v1::PrefillRequest* request) {
  std::unique_ptr<v1::Tensor> q(request->release_q());
  std::unique_ptr<v1::Tensor> append_k(request->release_append_k());
  std::unique_ptr<v1::Tensor> append_v(request->release_append_v());
  request->Clear();  // repeated fields keep their capacity
  int64_t kept = static_cast<int64_t>(request->qo_indptr().Capacity() +
                                      request->kv_indptr().Capacity() +
                                      request->kv_indices().Capacity() +
                                      request->kv_last_page_len().Capacity() +
                                      request->kv_keys_after().Capacity()) * 4 +
                 static_cast<int64_t>(request->append_slots().Capacity()) * 8;
  for (v1::Tensor* t : {q.get(), append_k.get(), append_v.get()}) {
    if (t == nullptr) continue;
    t->Clear();  // keeps the data string's capacity
    kept += static_cast<int64_t>(t->data().capacity());
  }
  if (q != nullptr) request->set_allocated_q(q.release());
  if (append_k != nullptr) request->set_allocated_append_k(append_k.release());
  if (append_v != nullptr) request->set_allocated_append_v(append_v.release());
  return kept;
}

absl::Status ParseInto(const grpc::ByteBuffer& bytes, const WireMessage& limits,
                       google::protobuf::MessageLite* request) {
  ATTN_RETURN_IF_ERROR(CheckWire(bytes, limits));
  // The reader only reads; gRPC's API takes the buffer non-const.
  grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(&bytes));
  // Merge, not Parse: Parse would Clear() first and drop the kept tensors.
  // Bounded by the message's real size: an unbounded stream lets a field
  // that claims more bytes than the message holds reserve up to 50 MB first.
  if (!reader.status().ok() ||
      !request->MergeFromBoundedZeroCopyStream(&reader, static_cast<int>(bytes.Length())) ||
      !reader.status().ok()) {
    return absl::InvalidArgumentError(absl::StrCat("request does not parse as ", limits.name));
  }
  return absl::OkStatus();
}

namespace {

// An owner shared by the slices that reference its memory; the last slice
// gRPC releases deletes it.
template <typename T>
struct SharedOwner {
  SharedOwner(T v, int refs) : value(std::move(v)), refs(refs) {}
  T value;
  std::atomic<int> refs;
  static void Unref(void* p) {
    auto* self = static_cast<SharedOwner*>(p);
    if (self->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete self;
  }
};

// A tensor to encode: its header, and its data in memory an owner keeps.
struct OutTensor {
  int32_t dtype;
  std::vector<int64_t> shape;
  char* data;
  size_t bytes;
};

// Response wire bytes: Tensor fields 1 and 2, then the fixed64 incarnation
// (field 3, when not 0). Their data is referenced, never copied: the owner
// lives until gRPC has released the last slice.
template <typename Owner>
grpc::ByteBuffer EncodeTwoTensors(const OutTensor& first, const OutTensor& second,
                                  uint64_t incarnation, Owner owner) {
  const int refs = (first.bytes > 0) + (second.bytes > 0);
  auto* shared = refs > 0 ? new SharedOwner<Owner>(std::move(owner), refs) : nullptr;
  WireWriter w;
  uint32_t field = 1;
  for (const OutTensor* t : {&first, &second}) {
    if (t->bytes > 0) {
      w.AppendTensor(field, t->dtype, t->shape,
                     grpc::Slice(t->data, t->bytes, &SharedOwner<Owner>::Unref, shared), t->bytes);
    } else {
      w.AppendTensor(field, t->dtype, t->shape, grpc::Slice(), 0);
    }
    ++field;
  }
  if (incarnation != 0) {
    std::string tail;
    google::protobuf::io::StringOutputStream stream(&tail);
    {
      google::protobuf::io::CodedOutputStream coded(&stream);
      coded.WriteTag(google::protobuf::internal::WireFormatLite::MakeTag(
          3, google::protobuf::internal::WireFormatLite::WIRETYPE_FIXED64));
      coded.WriteLittleEndian64(incarnation);
    }
    w.AppendCopy(tail);
  }
  return w.Finish();
}

OutTensor Out(v1::Tensor* t) {
  std::string* data = t->mutable_data();
  return OutTensor{t->dtype(), std::vector<int64_t>(t->shape().begin(), t->shape().end()),
                   data->data(), data->size()};
}

}  // namespace

grpc::ByteBuffer EncodePrefillResponse(PrefillOutput out, uint64_t incarnation) {
  const OutTensor o{ToProto(out.dtype), {out.total_q, out.num_qo_heads, out.head_dim},
                    out.buffer.data(), static_cast<size_t>(out.o_bytes)};
  const OutTensor lse{v1::DTYPE_FP32, {out.total_q, out.num_qo_heads},
                      out.buffer.data() + out.lse_offset, static_cast<size_t>(out.lse_bytes)};
  return EncodeTwoTensors(o, lse, incarnation, std::move(out.buffer));
}

grpc::ByteBuffer EncodeTensorResponse(std::unique_ptr<v1::ReadKVResponse> response) {
  const OutTensor k = Out(response->mutable_k());
  const OutTensor v = Out(response->mutable_v());
  const uint64_t incarnation = response->incarnation();
  return EncodeTwoTensors(k, v, incarnation, std::move(response));
}

grpc::ByteBuffer EncodeTensorResponse(std::unique_ptr<v1::MergeStatesResponse> response) {
  const OutTensor v = Out(response->mutable_v());
  const OutTensor lse = Out(response->mutable_lse());
  const uint64_t incarnation = response->incarnation();
  return EncodeTwoTensors(v, lse, incarnation, std::move(response));
}

void SetTensorHeader(v1::Tensor* t, v1::DType dtype, absl::Span<const int64_t> shape) {
  t->set_dtype(dtype);
  t->mutable_shape()->Assign(shape.begin(), shape.end());
}

}  // namespace attnserve
