// Tensor-carrying attnserve.v1 messages on the wire without copying tensor
// bytes: shared by the server's gRPC edge, the C++ client and attnecho.
//
// Sending: a message is the small fields serialized by protobuf, followed by
// each Tensor field written here as a head (tag, length, dtype, shape, the
// data field's tag and length) and a slice that references the tensor's
// memory. Protobuf parsers accept fields in any order and merge repeated
// occurrences of a message field, so the bytes parse as the same message.
//
//   WireWriter w;
//   w.AppendCopy(small_fields.SerializeAsString());
//   w.AppendTensor(2, v1::DTYPE_BF16, {rows, heads, dim}, q.data(), q_bytes,
//                  WireWriter::Borrowed(&borrowed));
//   grpc::ByteBuffer bytes = w.Finish();
//
// Receiving: ReadTensorResponse walks a response whose fields 1 and 2 are
// Tensors and 3 the fixed64 incarnation (PrefillResponse, ReadKVResponse,
// MergeStatesResponse) slice by slice and copies each tensor's data straight
// into memory the caller provides once its size is known: one copy, with no
// flattened buffer and no intermediate proto string. ReadTensorFields, the
// Tensor walk beneath it, also serves the server's edge, which leaves a
// request tensor's data in gRPC's slices (server/grpc/convert.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "google/protobuf/io/coded_stream.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace attnserve {

// Counts the slices that reference memory the caller owns and must keep
// until gRPC has released them (the C++ client's request tensors: spans of
// the caller's memory). WaitReleased blocks until every slice handed out has
// been released, which gRPC does once the bytes are written and the call is
// destroyed (after a unary call returns and its ClientContext is gone).
class BorrowedMemory {
 public:
  BorrowedMemory() = default;
  BorrowedMemory(const BorrowedMemory&) = delete;
  BorrowedMemory& operator=(const BorrowedMemory&) = delete;
  ~BorrowedMemory() { WaitReleased(); }

  // A slice over [data, data + bytes), counted until gRPC releases it.
  grpc::Slice Borrow(const void* data, size_t bytes);
  void WaitReleased();
  // Slices handed out and not yet released (for tests).
  int64_t outstanding() const;

 private:
  static void Release(void* self);

  mutable absl::Mutex mu_;
  int64_t outstanding_ ABSL_GUARDED_BY(mu_) = 0;
};

// Builds a message's wire bytes from copied small pieces and referenced
// tensor data. Adjacent copied pieces share one slice.
class WireWriter {
 public:
  // Appends bytes, copied (small fields, serialized by protobuf).
  void AppendCopy(absl::string_view bytes) { pending_.append(bytes.data(), bytes.size()); }
  // Appends a tag and varint length of a length-delimited field whose
  // payload follows (a nested message built piecewise).
  void AppendLengthPrefix(uint32_t field, uint64_t length);
  // Appends Tensor field `field` (dtype, shape and `bytes` of data) whose
  // data is the slice `data` (bytes long; from BorrowedMemory::Borrow or an
  // owning grpc::Slice). bytes == 0 writes no data field and ignores `data`.
  void AppendTensor(uint32_t field, int32_t dtype, absl::Span<const int64_t> shape,
                    grpc::Slice data, size_t bytes);
  // The same with the data copied into the message (small tensors).
  void AppendTensorCopy(uint32_t field, int32_t dtype, absl::Span<const int64_t> shape,
                        const void* data, size_t bytes);
  // Bytes appended so far.
  size_t size() const { return flushed_ + pending_.size(); }
  grpc::ByteBuffer Finish();

 private:
  void Flush();

  std::string pending_;
  std::vector<grpc::Slice> slices_;
  size_t flushed_ = 0;
};

// The size on the wire of Tensor field `field` with `bytes` of data: what
// AppendTensor appends (for the length of an enclosing message).
size_t TensorFieldSize(uint32_t field, int32_t dtype, absl::Span<const int64_t> shape,
                       size_t bytes);

// One Tensor of a received response.
struct ReceivedTensor {
  int32_t dtype = 0;
  std::vector<int64_t> shape;
  size_t bytes = 0;     // data bytes received
  bool present = false;  // the field occurred
};

// Where a received tensor's data goes: called when its data field is read,
// with the data's size, it returns memory for that many bytes (null rejects
// the message: INVALID_ARGUMENT). A tensor without data (empty, or in a
// region) never calls it; a repeated data field calls it again (last wins).
using TensorSink = std::function<void*(size_t bytes)>;

// Reads the fields of one Tensor message from `in`, up to its current
// limit, into *t as protobuf merges repeated occurrences: dtype, last wins;
// shape, appended. Each data field is left to read_data, called with the
// position (in->CurrentPosition()) of the field's tag and its payload's
// length, which is known to lie within the limit; the stream is at the
// payload, and read_data must consume exactly `length` bytes and return
// true, or return false to reject the message. Unknown fields are skipped.
// False when the bytes do not parse as a Tensor.
using TensorDataReader = absl::FunctionRef<bool(google::protobuf::io::CodedInputStream* in,
                                                int field_start, uint32_t length)>;
bool ReadTensorFields(google::protobuf::io::CodedInputStream* in, ReceivedTensor* t,
                      TensorDataReader read_data);

// Appends the tag and varint length of length-delimited field `field`.
void AppendLengthPrefix(uint32_t field, uint64_t length, std::string* out);

// Walks a PrefillResponse, ReadKVResponse or MergeStatesResponse: Tensor
// fields 1 and 2 go to first/second (their data to the sinks), the fixed64
// field 3 to *incarnation. Unknown fields are skipped, as protobuf would.
// INVALID_ARGUMENT naming `what` when the bytes do not parse.
absl::Status ReadTensorResponse(const grpc::ByteBuffer& bytes, const char* what,
                                ReceivedTensor* first, const TensorSink& first_sink,
                                ReceivedTensor* second, const TensorSink& second_sink,
                                uint64_t* incarnation);

}  // namespace attnserve
