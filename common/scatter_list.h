// ScatterList: a tensor's bytes held in several pieces of host memory, in
// order, viewed without copying. An inline request tensor arrives this way:
// its data stays in the slices gRPC received the request's wire bytes in
// (server/grpc/convert.h), which the edge keeps until the call is finished.
// Whoever copies the tensor anyway gathers the pieces in that copy (the CUDA
// backend's packer, into its pinned staging); the CPU backend flattens them.
//
//   ScatterList list = ...;             // list.size bytes in all
//   CopyOut(list, offset, n, dst);      // bytes [offset, offset + n) to dst
//   CopyBytes(dst, src, n);             // a memcpy, threaded when large
//
// The pieces are not aligned to anything: a piece starts wherever the tensor's
// bytes started in a slice.
#pragma once

#include <cstdint>

#include "absl/types/span.h"

namespace attnserve {

struct ScatterPiece {
  int64_t offset = 0;  // where the piece starts within the list's bytes
  const char* data = nullptr;
  int64_t size = 0;    // bytes, > 0
};

struct ScatterList {
  // In order: pieces[0].offset == 0, each next one starts where the previous
  // one ends, and the last one ends at `size`. Empty: no scattered bytes.
  absl::Span<const ScatterPiece> pieces;
  int64_t size = 0;
  bool empty() const { return pieces.empty(); }
};

// Copies bytes [offset, offset + n) of `list` to dst, which must not overlap
// them; the range must lie within [0, list.size). The first piece is found by
// binary search, so copying a list row by row costs O(rows log pieces) beside
// the bytes. A copy of kParallelCopyMinBytes or more is split over threads
// (CopyBytes).
void CopyOut(const ScatterList& list, int64_t offset, int64_t n, void* dst);

// Copies of at least this many bytes are split over up to 8 threads (and at
// most half the host's cores): one core's memcpy from gRPC's slices into
// pinned staging moved 128 MiB in about 21 ms on the H200 host, several times
// what the copy engines need (bench/results/2026-12-01-session4-h200.md).
// The server gathers inline inputs this way, the client library its
// responses' tensors (common/tensor_wire.cc).
constexpr int64_t kParallelCopyMinBytes = int64_t{8} << 20;

// memcpy of n bytes, split over threads from kParallelCopyMinBytes on.
void CopyBytes(void* dst, const void* src, int64_t n);

}  // namespace attnserve
