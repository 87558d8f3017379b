// Inline inputs as the edge hands them to a backend: a tensor's bytes in
// pieces, each in a buffer of its own at an odd address (as they arrive in
// gRPC's slices). Shared by the packer and CPU backend tests.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/scatter_list.h"

namespace attnserve {

// `size` bytes at `data` as pieces of 1 to max_piece bytes. Neither copied
// nor moved: `list` points into this object's buffers (hold several in a
// std::deque).
struct Pieces {
  Pieces(const void* data, int64_t size, size_t max_piece, uint32_t seed) {
    std::mt19937 rng(seed);
    const auto* bytes = static_cast<const char*>(data);
    for (int64_t at = 0; at < size;) {
      const int64_t n = std::min<int64_t>(size - at, 1 + rng() % max_piece);
      buffers.push_back("x" + std::string(bytes + at, static_cast<size_t>(n)));
      at += n;
    }
    int64_t offset = 0;
    for (const std::string& b : buffers) {
      pieces.push_back({offset, b.data() + 1, static_cast<int64_t>(b.size()) - 1});
      offset += static_cast<int64_t>(b.size()) - 1;
    }
    list = ScatterList{pieces, offset};
  }
  Pieces(const Pieces&) = delete;
  Pieces& operator=(const Pieces&) = delete;
  std::vector<std::string> buffers;
  std::vector<ScatterPiece> pieces;
  ScatterList list;
};

}  // namespace attnserve
