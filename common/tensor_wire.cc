#include "common/tensor_wire.h"

#include <algorithm>
#include <climits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/scatter_list.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace attnserve {
namespace {

using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using google::protobuf::internal::WireFormatLite;

constexpr uint32_t kDtypeField = 1;  // Tensor.dtype, varint
constexpr uint32_t kShapeField = 2;  // Tensor.shape, packed int64
constexpr uint32_t kDataField = 3;   // Tensor.data, bytes

void PutVarint(uint64_t value, std::string* out) {
  while (value >= 0x80) {
    out->push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out->push_back(static_cast<char>(value));
}

void PutTag(uint32_t field, WireFormatLite::WireType type, std::string* out) {
  PutVarint(WireFormatLite::MakeTag(static_cast<int>(field), type), out);
}

size_t ShapeBytes(absl::Span<const int64_t> shape) {
  size_t n = 0;
  for (int64_t s : shape) n += CodedOutputStream::VarintSize64(static_cast<uint64_t>(s));
  return n;
}

// The Tensor message's bytes before its data, without the field's own tag
// and length: dtype, packed shape, and the data field's tag and length.
size_t InnerHeadSize(int32_t dtype, absl::Span<const int64_t> shape, size_t bytes) {
  size_t n = 0;
  if (dtype != 0) {
    n += 1 + CodedOutputStream::VarintSize64(static_cast<uint64_t>(static_cast<int64_t>(dtype)));
  }
  const size_t shape_bytes = ShapeBytes(shape);
  if (shape_bytes > 0) n += 1 + CodedOutputStream::VarintSize64(shape_bytes) + shape_bytes;
  if (bytes > 0) n += 1 + CodedOutputStream::VarintSize64(bytes);
  return n;
}

// Appends what precedes a Tensor field's data, in the order the generated
// serializer writes the fields.
void PutTensorHead(uint32_t field, int32_t dtype, absl::Span<const int64_t> shape, size_t bytes,
                   std::string* out) {
  PutTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, out);
  PutVarint(InnerHeadSize(dtype, shape, bytes) + bytes, out);
  if (dtype != 0) {
    PutTag(kDtypeField, WireFormatLite::WIRETYPE_VARINT, out);
    PutVarint(static_cast<uint64_t>(static_cast<int64_t>(dtype)), out);  // enums sign-extend
  }
  const size_t shape_bytes = ShapeBytes(shape);
  if (shape_bytes > 0) {
    PutTag(kShapeField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, out);
    PutVarint(shape_bytes, out);
    for (int64_t s : shape) PutVarint(static_cast<uint64_t>(s), out);
  }
  if (bytes > 0) {
    PutTag(kDataField, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, out);
    PutVarint(bytes, out);
  }
}

}  // namespace

bool ReadTensorFields(CodedInputStream* in, ReceivedTensor* t, TensorDataReader read_data) {
  for (;;) {
    const int field_start = in->CurrentPosition();
    const uint32_t tag = in->ReadTag();
    if (tag == 0) return in->BytesUntilLimit() == 0;
    const uint32_t number = WireFormatLite::GetTagFieldNumber(tag);
    const auto type = WireFormatLite::GetTagWireType(tag);
    if (number == kDtypeField && type == WireFormatLite::WIRETYPE_VARINT) {
      uint64_t v = 0;
      if (!in->ReadVarint64(&v)) return false;
      t->dtype = static_cast<int32_t>(v);
    } else if (number == kShapeField && type == WireFormatLite::WIRETYPE_VARINT) {
      uint64_t v = 0;
      if (!in->ReadVarint64(&v)) return false;
      t->shape.push_back(static_cast<int64_t>(v));
    } else if (number == kShapeField && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in->ReadVarint32(&length)) return false;
      const CodedInputStream::Limit limit = in->PushLimit(static_cast<int>(length));
      while (in->BytesUntilLimit() > 0) {
        uint64_t v = 0;
        if (!in->ReadVarint64(&v)) return false;
        t->shape.push_back(static_cast<int64_t>(v));
      }
      in->PopLimit(limit);
    } else if (number == kDataField && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in->ReadVarint32(&length)) return false;
      if (static_cast<int64_t>(length) > in->BytesUntilLimit()) return false;
      if (!read_data(in, field_start, length)) return false;
      t->bytes = length;
    } else if (!WireFormatLite::SkipField(in, tag)) {
      return false;
    }
  }
}

void AppendLengthPrefix(uint32_t field, uint64_t length, std::string* out) {
  PutTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED, out);
  PutVarint(length, out);
}

grpc::Slice BorrowedMemory::Borrow(const void* data, size_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    ++outstanding_;
  }
  // gRPC only reads a send slice; its API takes the pointer non-const.
  return grpc::Slice(const_cast<void*>(data), bytes, &BorrowedMemory::Release, this);
}

void BorrowedMemory::Release(void* self) {
  auto* borrowed = static_cast<BorrowedMemory*>(self);
  absl::MutexLock lock(&borrowed->mu_);
  --borrowed->outstanding_;
}

void BorrowedMemory::WaitReleased() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int64_t* outstanding) { return *outstanding == 0; }, &outstanding_));
}

int64_t BorrowedMemory::outstanding() const {
  absl::MutexLock lock(&mu_);
  return outstanding_;
}

void WireWriter::AppendLengthPrefix(uint32_t field, uint64_t length) {
  attnserve::AppendLengthPrefix(field, length, &pending_);
}

void WireWriter::AppendTensor(uint32_t field, int32_t dtype, absl::Span<const int64_t> shape,
                              grpc::Slice data, size_t bytes) {
  PutTensorHead(field, dtype, shape, bytes, &pending_);
  if (bytes == 0) return;
  Flush();
  flushed_ += bytes;
  slices_.push_back(std::move(data));
}

void WireWriter::AppendTensorCopy(uint32_t field, int32_t dtype, absl::Span<const int64_t> shape,
                                  const void* data, size_t bytes) {
  PutTensorHead(field, dtype, shape, bytes, &pending_);
  if (bytes > 0) pending_.append(static_cast<const char*>(data), bytes);
}

void WireWriter::Flush() {
  if (pending_.empty()) return;
  flushed_ += pending_.size();
  slices_.emplace_back(pending_);  // copies the small bytes into a gRPC slice
  pending_.clear();
}

grpc::ByteBuffer WireWriter::Finish() {
  Flush();
  grpc::ByteBuffer out(slices_.data(), slices_.size());
  slices_.clear();
  flushed_ = 0;
  return out;
}

size_t TensorFieldSize(uint32_t field, int32_t dtype, absl::Span<const int64_t> shape,
                       size_t bytes) {
  const size_t inner = InnerHeadSize(dtype, shape, bytes) + bytes;
  return CodedOutputStream::VarintSize32(
             WireFormatLite::MakeTag(static_cast<int>(field),
                                     WireFormatLite::WIRETYPE_LENGTH_DELIMITED)) +
         CodedOutputStream::VarintSize64(inner) + inner;
}

absl::Status ReadTensorResponse(const grpc::ByteBuffer& bytes, const char* what,
                                ReceivedTensor* first, const TensorSink& first_sink,
                                ReceivedTensor* second, const TensorSink& second_sink,
                                uint64_t* incarnation) {
  const auto malformed = [what] {
    return absl::InvalidArgumentError(absl::StrCat("response does not parse as ", what));
  };
  // The reader only reads; gRPC's API takes the buffer non-const.
  grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(&bytes));
  if (!reader.status().ok()) return malformed();
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT_MAX);
  const CodedInputStream::Limit all = in.PushLimit(static_cast<int>(
      std::min<size_t>(bytes.Length(), static_cast<size_t>(INT_MAX))));
  *first = ReceivedTensor{};
  *second = ReceivedTensor{};
  *incarnation = 0;
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) {
      if (in.BytesUntilLimit() != 0) return malformed();
      break;
    }
    const uint32_t number = WireFormatLite::GetTagFieldNumber(tag);
    const auto type = WireFormatLite::GetTagWireType(tag);
    if ((number == 1 || number == 2) && type == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
      uint32_t length = 0;
      if (!in.ReadVarint32(&length) || static_cast<int64_t>(length) > in.BytesUntilLimit()) {
        return malformed();
      }
      ReceivedTensor* t = number == 1 ? first : second;
      t->present = true;
      const TensorSink& sink = number == 1 ? first_sink : second_sink;
      const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(length));
      const auto copy_data = [&sink](CodedInputStream* data_in, int, uint32_t data_length) {
        void* dest = sink(data_length);
        if (dest == nullptr && data_length > 0) return false;
        if (data_length < kParallelCopyMinBytes) {
          return data_length == 0 || data_in->ReadRaw(dest, static_cast<int>(data_length));
        }
        // A large tensor: the pieces of gRPC's slices it lies in (the
        // ByteBuffer keeps them), then one copy split over threads.
        std::vector<ScatterPiece> pieces;
        int64_t at = 0;
        while (at < data_length) {
          const void* data = nullptr;
          int size = 0;
          if (!data_in->GetDirectBufferPointer(&data, &size) || size <= 0) return false;
          const int64_t take = std::min<int64_t>(size, data_length - at);
          pieces.push_back({at, static_cast<const char*>(data), take});
          if (!data_in->Skip(static_cast<int>(take))) return false;
          at += take;
        }
        CopyOut(ScatterList{pieces, static_cast<int64_t>(data_length)}, 0, data_length, dest);
        return true;
      };
      if (!ReadTensorFields(&in, t, copy_data)) return malformed();
      in.PopLimit(limit);
    } else if (number == 3 && type == WireFormatLite::WIRETYPE_FIXED64) {
      if (!in.ReadLittleEndian64(incarnation)) return malformed();
    } else if (!WireFormatLite::SkipField(&in, tag)) {
      return malformed();
    }
  }
  in.PopLimit(all);
  if (!reader.status().ok()) return malformed();
  return absl::OkStatus();
}

}  // namespace attnserve
