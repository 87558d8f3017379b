#include "server/grpc/convert.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
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

// Top-level field `field`, read in place or not.
TensorView View(const v1::Tensor& t, uint32_t field, const InPlaceTensors& tensors) {
  TensorView view = View(t);
  tensors.View(field, &view);
  return view;
}

const InPlaceTensors& NoneInPlace() {
  static const InPlaceTensors* none = new InPlaceTensors();
  return *none;
}

// A ZeroCopyInputStream over pieces of memory, in order, without copying.
class PiecesInputStream final : public google::protobuf::io::ZeroCopyInputStream {
 public:
  explicit PiecesInputStream(absl::Span<const absl::string_view> pieces) : pieces_(pieces) {}

  bool Next(const void** data, int* size) override {
    while (index_ < pieces_.size() && at_ == pieces_[index_].size()) {
      ++index_;
      at_ = 0;
    }
    if (index_ == pieces_.size()) return false;
    const size_t n = std::min<size_t>(pieces_[index_].size() - at_, INT_MAX);
    *data = pieces_[index_].data() + at_;
    *size = static_cast<int>(n);
    at_ += n;
    count_ += static_cast<int64_t>(n);
    return true;
  }
  // Within what the last Next returned (ZeroCopyInputStream's contract).
  void BackUp(int count) override {
    at_ -= static_cast<size_t>(count);
    count_ -= count;
  }
  bool Skip(int count) override {
    size_t left = static_cast<size_t>(count);
    while (left > 0) {
      if (index_ == pieces_.size()) return false;
      const size_t n = std::min(left, pieces_[index_].size() - at_);
      at_ += n;
      count_ += static_cast<int64_t>(n);
      left -= n;
      if (at_ == pieces_[index_].size()) {
        ++index_;
        at_ = 0;
      }
    }
    return true;
  }
  int64_t ByteCount() const override { return count_; }

 private:
  const absl::Span<const absl::string_view> pieces_;
  size_t index_ = 0;  // the piece being read
  size_t at_ = 0;     // bytes of it handed out
  int64_t count_ = 0;
};

// A message's slices as one byte range: any sub-range as views of them.
class SliceRanges {
 public:
  explicit SliceRanges(const std::vector<grpc::Slice>& slices) {
    int64_t at = 0;
    for (const grpc::Slice& s : slices) {
      if (s.size() == 0) continue;
      views_.emplace_back(reinterpret_cast<const char*>(s.begin()), s.size());
      starts_.push_back(at);
      at += static_cast<int64_t>(s.size());
    }
  }
  const std::vector<absl::string_view>& views() const { return views_; }

  // Calls emit(data, size, offset) for the pieces of bytes [begin, end),
  // offset counted from begin. The range lies within the message.
  template <typename Emit>
  void ForEach(int64_t begin, int64_t end, Emit emit) const {
    if (begin >= end) return;
    size_t i = static_cast<size_t>(
        std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1);
    for (int64_t at = begin; at < end; ++i) {
      const int64_t skip = at - starts_[i];
      const int64_t take =
          std::min<int64_t>(end - at, static_cast<int64_t>(views_[i].size()) - skip);
      emit(views_[i].data() + skip, take, at - begin);
      at += take;
    }
  }
  void Append(int64_t begin, int64_t end, std::vector<absl::string_view>* out) const {
    ForEach(begin, end, [out](const char* data, int64_t size, int64_t) {
      out->emplace_back(data, static_cast<size_t>(size));
    });
  }

 private:
  std::vector<absl::string_view> views_;
  std::vector<int64_t> starts_;  // of each view in the message
};

template <typename T>
absl::Span<const T> Span(const google::protobuf::RepeatedField<T>& field) {
  return absl::MakeConstSpan(field.data(), static_cast<size_t>(field.size()));
}

AttentionOptionsView OptionsView(const v1::AttentionOptions& o) {
  AttentionOptionsView view;
  if (o.has_window_left()) view.window_left = o.window_left();
  if (o.has_logits_soft_cap()) view.logits_soft_cap = o.logits_soft_cap();
  view.sinks = Span(o.sinks());
  return view;
}

// Whether protobuf's parser takes bytes [begin, end) of the message, a
// field's tag and length that CodedInputStream read, as it would read them
// itself: a tag of at most 5 bytes, a length of at most 5 bytes (the fifth
// below 8) and at most INT_MAX - 16. CodedInputStream takes varints of up to
// 10 bytes; the generated parser, which the in-place parse must match
// exactly, does not.
bool ProtobufTakesPrefix(const SliceRanges& ranges, int begin, int end) {
  uint8_t prefix[20];
  if (end - begin > static_cast<int>(sizeof(prefix))) return false;
  ranges.ForEach(begin, end, [&prefix](const char* data, int64_t size, int64_t offset) {
    std::memcpy(prefix + offset, data, static_cast<size_t>(size));
  });
  const int n = end - begin;
  int tag_bytes = 0;
  while (tag_bytes < n && (prefix[tag_bytes] & 0x80) != 0) ++tag_bytes;
  ++tag_bytes;
  const int length_bytes = n - tag_bytes;
  if (tag_bytes > 5 || length_bytes < 1 || length_bytes > 5) return false;
  if (length_bytes == 5 && prefix[n - 1] >= 8) return false;
  uint64_t length = 0;
  for (int i = 0; i < length_bytes; ++i) {
    length |= uint64_t{prefix[tag_bytes + i] & 0x7fu} << (7 * i);
  }
  return length <= static_cast<uint64_t>(INT_MAX - 16);
}

}  // namespace

TensorDType FromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_UNSPECIFIED: return TensorDType::kUnspecified;
    case v1::DTYPE_BF16: return TensorDType::kBf16;
    case v1::DTYPE_FP16: return TensorDType::kFp16;
    case v1::DTYPE_FP32: return TensorDType::kFp32;
    case v1::DTYPE_FP8_E4M3: return TensorDType::kFp8E4m3;
    case v1::DTYPE_FP8_E5M2: return TensorDType::kFp8E5m2;
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

v1::DType ToProto(TensorDType dtype) {
  switch (dtype) {
    case TensorDType::kBf16: return v1::DTYPE_BF16;
    case TensorDType::kFp16: return v1::DTYPE_FP16;
    case TensorDType::kFp32: return v1::DTYPE_FP32;
    case TensorDType::kFp8E4m3: return v1::DTYPE_FP8_E4M3;
    case TensorDType::kFp8E5m2: return v1::DTYPE_FP8_E5M2;
    case TensorDType::kUnspecified:
    case TensorDType::kUnknown: break;
  }
  return v1::DTYPE_UNSPECIFIED;
}

v1::DType KvDTypeProto(const KvGeometry& geo) {
  return geo.KvIsFp8() ? ToProto(TensorDTypeOf(geo.kv_fp8)) : ToProto(geo.dtype);
}

SetKvScalesCall ToCall(const v1::SetKvScalesRequest& r) {
  SetKvScalesCall call;
  call.layers.reserve(r.layers_size());
  for (const v1::LayerKvScales& l : r.layers()) {
    call.layers.push_back({l.layer(), Span(l.k_scale()), Span(l.v_scale())});
  }
  return call;
}

bool InPlaceTensors::View(uint32_t field, TensorView* view) const {
  for (const Field& f : fields_) {
    if (f.number != field) continue;
    view->data = absl::string_view();
    view->scattered = ScatterList();
    if (f.num_pieces == 1) {
      const ScatterPiece& p = pieces_[f.first_piece];
      view->data = absl::string_view(p.data, static_cast<size_t>(p.size));
    } else if (f.num_pieces > 1) {
      view->scattered.pieces = absl::MakeConstSpan(pieces_.data() + f.first_piece, f.num_pieces);
      view->scattered.size = f.bytes;
    }
    return true;
  }
  return false;
}

int64_t InPlaceTensors::held_bytes() const {
  int64_t n = 0;
  for (const grpc::Slice& s : slices_) n += static_cast<int64_t>(s.size());
  return n;
}

void InPlaceTensors::Clear() {
  slices_.clear();
  fields_.clear();
  pieces_.clear();
}

void ToCall(const v1::PrefillRequest& r, PrefillCall* c) { ToCall(r, NoneInPlace(), c); }

void ToCall(const v1::PrefillRequest& r, const InPlaceTensors& tensors, PrefillCall* c) {
  c->layer = r.layer();
  c->q = View(r.q(), v1::PrefillRequest::kQFieldNumber, tensors);
  c->qo_indptr = Span(r.qo_indptr());
  c->kv_indptr = Span(r.kv_indptr());
  c->kv_indices = Span(r.kv_indices());
  c->kv_last_page_len = Span(r.kv_last_page_len());
  if (r.has_sm_scale()) c->sm_scale = r.sm_scale();
  if (r.has_causal()) c->causal = r.causal();
  c->lse_base = r.lse_base();
  c->append_slots = Span(r.append_slots());
  c->append_k = View(r.append_k(), v1::PrefillRequest::kAppendKFieldNumber, tensors);
  c->append_v = View(r.append_v(), v1::PrefillRequest::kAppendVFieldNumber, tensors);
  c->kv_keys_after = Span(r.kv_keys_after());
  c->apply_sinks = Span(r.apply_sinks());
  c->options = OptionsView(r.options());
  c->plan_id = r.plan_id();
  c->out_region = RefView(r.has_output_region(), r.output_region());
  c->lse_region = RefView(r.has_lse_region(), r.lse_region());
}

namespace {
constexpr int32_t kDecodeMaxRows = 8;
}  // namespace

Metrics::Shape ShapeOfRows(int64_t max_seq_q_rows) {
  return max_seq_q_rows > kDecodeMaxRows ? Metrics::Shape::kPrefill : Metrics::Shape::kDecode;
}

Metrics::Shape PrefillShape(const v1::PrefillRequest& r) {
  if (r.plan_id() != 0) return Metrics::Shape::kPrefill;  // until the plan is found
  for (int i = 1; i < r.qo_indptr_size(); ++i) {
    // In 64 bits: the request is not validated yet (any two int32s).
    if (int64_t{r.qo_indptr(i)} - r.qo_indptr(i - 1) > kDecodeMaxRows) return Metrics::Shape::kPrefill;
  }
  return Metrics::Shape::kDecode;
}

PrefillLayout ToLayout(const v1::CreatePlanRequest& r) {
  return PrefillLayout{Span(r.qo_indptr()),        Span(r.kv_indptr()),
                       Span(r.kv_indices()),       Span(r.kv_last_page_len()),
                       Span(r.append_slots()),     Span(r.kv_keys_after()),
                       Span(r.apply_sinks())};
}

PlanOptionsView ToPlanOptions(const v1::CreatePlanRequest& r) {
  PlanOptionsView view;
  view.all = OptionsView(r.options());
  view.layers.reserve(r.layer_options_size());
  for (const auto& [layer, options] : r.layer_options()) {
    view.layers.emplace_back(layer, OptionsView(options));
  }
  return view;
}

void ToCall(const v1::WriteKVRequest& r, WriteKvCall* c) { ToCall(r, NoneInPlace(), c); }

void ToCall(const v1::WriteKVRequest& r, const InPlaceTensors& tensors, WriteKvCall* c) {
  c->layer = r.layer();
  c->slots = Span(r.slots());
  c->k = View(r.k(), v1::WriteKVRequest::kKFieldNumber, tensors);
  c->v = View(r.v(), v1::WriteKVRequest::kVFieldNumber, tensors);
}

void ToCall(const v1::ReadKVRequest& r, v1::ReadKVResponse* response, ReadKvCall* c) {
  c->layer = r.layer();
  c->slots = Span(r.slots());
  c->dequantize = r.dequantize();
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

RegionRefView ToRingRef(const v1::OpenChannelRequest& r) {
  return RefView(r.has_ring(), r.ring());
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
    spec.claim_token = r.system().claim_token();
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
                 static_cast<int64_t>(request->append_slots().Capacity()) * 8 +
                 static_cast<int64_t>(request->apply_sinks().Capacity());
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

absl::Status ParseInto(const grpc::ByteBuffer& bytes, const WireMessage& limits,
                       absl::Span<const uint32_t> in_place, google::protobuf::MessageLite* request,
                       InPlaceTensors* tensors) {
  using google::protobuf::io::CodedInputStream;
  using google::protobuf::internal::WireFormatLite;
  ATTN_RETURN_IF_ERROR(CheckWire(bytes, limits));  // also: at most INT_MAX bytes
  const auto malformed = [&limits] {
    return absl::InvalidArgumentError(absl::StrCat("request does not parse as ", limits.name));
  };
  tensors->Clear();
  // References to gRPC's slices (no copy): they outlive `bytes`.
  if (bytes.Length() > 0 && !bytes.Dump(&tensors->slices_).ok()) return malformed();
  const SliceRanges ranges(tensors->slices_);
  const int total = static_cast<int>(bytes.Length());

  // One walk over the top-level fields finds the in-place tensors and the
  // data fields in them. What protobuf then parses (`rest`) is the message
  // without those data fields: views of the slices, and for each in-place
  // tensor a new tag and length (its length less its data fields'). The
  // tags and lengths so taken out of protobuf's sight are held to its rules.
  std::vector<absl::string_view> rest;
  std::deque<std::string> heads;  // `rest` views them: a deque never moves its elements
  int copied = 0;  // `rest` covers the message up to here
  int64_t rest_bytes = 0;
  const auto keep = [&](int begin, int end) {
    ranges.Append(begin, end, &rest);
    rest_bytes += end - begin;
  };
  PiecesInputStream stream(ranges.views());
  CodedInputStream in(&stream);
  in.SetTotalBytesLimit(INT_MAX);
  in.PushLimit(total);
  for (;;) {
    const int field_begin = in.CurrentPosition();
    const uint32_t tag = in.ReadTag();
    if (tag == 0) {
      if (in.BytesUntilLimit() != 0) return malformed();
      break;
    }
    const uint32_t number = WireFormatLite::GetTagFieldNumber(tag);
    if (WireFormatLite::GetTagWireType(tag) != WireFormatLite::WIRETYPE_LENGTH_DELIMITED ||
        std::find(in_place.begin(), in_place.end(), number) == in_place.end()) {
      if (!WireFormatLite::SkipField(&in, tag)) return malformed();
      continue;
    }
    uint32_t length = 0;
    if (!in.ReadVarint32(&length) || static_cast<int64_t>(length) > in.BytesUntilLimit()) {
      return malformed();
    }
    const int body_begin = in.CurrentPosition();
    const int end = body_begin + static_cast<int>(length);
    if (!ProtobufTakesPrefix(ranges, field_begin, body_begin)) return malformed();
    // The tensor's data fields (tag to payload's end), and the last one's
    // payload: a repeated data field's last occurrence wins, as in protobuf.
    std::vector<std::pair<int, int>> cuts;
    int data_begin = 0;
    int64_t data_bytes = 0;
    const auto data = [&](CodedInputStream* data_in, int begin, uint32_t n) {
      data_begin = data_in->CurrentPosition();
      data_bytes = n;
      cuts.emplace_back(begin, data_begin + static_cast<int>(n));
      return ProtobufTakesPrefix(ranges, begin, data_begin) && data_in->Skip(static_cast<int>(n));
    };
    const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
    ReceivedTensor parsed;
    if (!ReadTensorFields(&in, &parsed, data)) return malformed();
    in.PopLimit(limit);

    keep(copied, field_begin);
    int64_t cut_bytes = 0;
    for (const auto& [begin, cut_end] : cuts) cut_bytes += cut_end - begin;
    heads.emplace_back();
    AppendLengthPrefix(number, static_cast<uint64_t>(length - cut_bytes), &heads.back());
    rest.emplace_back(heads.back());
    rest_bytes += static_cast<int64_t>(heads.back().size());
    int at = body_begin;
    for (const auto& [begin, cut_end] : cuts) {
      keep(at, begin);
      at = cut_end;
    }
    keep(at, end);
    copied = end;

    InPlaceTensors::Field field;
    field.number = number;
    field.bytes = data_bytes;
    field.first_piece = tensors->pieces_.size();
    ranges.ForEach(data_begin, data_begin + data_bytes,
                   [tensors](const char* p, int64_t size, int64_t offset) {
                     tensors->pieces_.push_back({offset, p, size});
                   });
    field.num_pieces = tensors->pieces_.size() - field.first_piece;
    // A field that occurs again (only where the wire limits allow it):
    // protobuf merges the occurrences, so its data replaces the earlier
    // one's if it has a data field.
    auto old = std::find_if(
        tensors->fields_.begin(), tensors->fields_.end(),
        [number](const InPlaceTensors::Field& f) { return f.number == number; });
    if (old == tensors->fields_.end()) {
      tensors->fields_.push_back(field);
    } else if (!cuts.empty()) {
      *old = field;
    }
  }
  keep(copied, total);

  PiecesInputStream rest_stream(rest);
  // Merge, not Parse, as ParseInto; bounded by what is left to parse.
  if (rest_bytes > INT_MAX ||
      !request->MergeFromBoundedZeroCopyStream(&rest_stream, static_cast<int>(rest_bytes))) {
    return malformed();
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
    if (t->dtype == v1::DTYPE_UNSPECIFIED && t->shape.empty() && t->bytes == 0) {
      ++field;  // unset (ReadKV's v on an MLA server)
      continue;
    }
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
  const OutTensor o{ToProto(out.dtype), {out.total_q, out.num_qo_heads, out.v_head_dim},
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
