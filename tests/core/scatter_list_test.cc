// ScatterList (common/scatter_list.h): any byte range copied out of
// pieces of random sizes equals the same range of the bytes they hold, below
// and above the size from which copies are split over threads.
#include "common/scatter_list.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(ScatterListTest, CopyOutOfAnyRangeEqualsTheBytes) {
  std::mt19937 rng(1);
  for (int trial = 0; trial < 50; ++trial) {
    std::string bytes(1 + rng() % 5000, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    // Each piece in a buffer of its own (no piece continues the previous one
    // in memory), of 1 to max_piece bytes.
    const size_t max_piece = trial % 5 == 0 ? bytes.size() : 1 + rng() % 300;
    std::vector<std::string> buffers;
    std::vector<ScatterPiece> pieces;
    for (size_t at = 0; at < bytes.size();) {
      const size_t n = std::min<size_t>(bytes.size() - at, 1 + rng() % max_piece);
      buffers.push_back(bytes.substr(at, n));
      at += n;
    }
    int64_t offset = 0;
    for (const std::string& b : buffers) {
      pieces.push_back({offset, b.data(), static_cast<int64_t>(b.size())});
      offset += static_cast<int64_t>(b.size());
    }
    const ScatterList list{pieces, offset};
    for (int r = 0; r < 40; ++r) {
      const size_t begin = rng() % bytes.size();
      const size_t n = r == 0 ? bytes.size() - begin : rng() % (bytes.size() - begin + 1);
      std::string out(n, '\0');
      CopyOut(list, static_cast<int64_t>(begin), static_cast<int64_t>(n), out.data());
      ASSERT_EQ(out, bytes.substr(begin, n))
          << "trial " << trial << " [" << begin << ", +" << n << ")";
    }
    std::string all(bytes.size(), '\0');
    CopyOut(list, 0, list.size, all.data());
    EXPECT_EQ(all, bytes);
  }
}

// Copies from kParallelCopyMinBytes on run on several threads: ranges that
// start and end anywhere (not on a thread's part or a page) still copy every
// byte once, and nothing outside the range is written.
TEST(ScatterListTest, LargeCopiesSplitOverThreadsEqualTheBytes) {
  std::mt19937_64 rng(7);
  const int64_t size = kParallelCopyMinBytes * 3 + 12345;
  std::string bytes(static_cast<size_t>(size), '\0');
  for (size_t i = 0; i < bytes.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&bytes[i], &v, std::min<size_t>(8, bytes.size() - i));
  }
  // Pieces of 1 MiB plus a random remainder, each in its own buffer.
  std::vector<std::string> buffers;
  std::vector<ScatterPiece> pieces;
  for (int64_t at = 0; at < size;) {
    const int64_t n = std::min<int64_t>(size - at, (int64_t{1} << 20) + static_cast<int64_t>(rng() % 70000));
    buffers.push_back(bytes.substr(static_cast<size_t>(at), static_cast<size_t>(n)));
    at += n;
  }
  int64_t offset = 0;
  for (const std::string& b : buffers) {
    pieces.push_back({offset, b.data(), static_cast<int64_t>(b.size())});
    offset += static_cast<int64_t>(b.size());
  }
  const ScatterList list{pieces, offset};
  for (const auto& [begin, n] : {std::pair<int64_t, int64_t>{0, size}, {777, kParallelCopyMinBytes + 4097},
                                 {5, size - 9}, {size - kParallelCopyMinBytes - 3, kParallelCopyMinBytes}}) {
    // Guard bytes on both sides catch writes outside the range.
    std::string out(static_cast<size_t>(n) + 64, '\x5a');
    CopyOut(list, begin, n, out.data() + 32);
    ASSERT_EQ(out.substr(32, static_cast<size_t>(n)), bytes.substr(static_cast<size_t>(begin), static_cast<size_t>(n)))
        << "[" << begin << ", +" << n << ")";
    EXPECT_EQ(out.substr(0, 32), std::string(32, '\x5a'));
    EXPECT_EQ(out.substr(static_cast<size_t>(n) + 32), std::string(32, '\x5a'));
    std::string flat(static_cast<size_t>(n) + 64, '\x5a');
    CopyBytes(flat.data() + 32, bytes.data() + begin, n);
    EXPECT_EQ(flat, out);
  }
}

}  // namespace
}  // namespace attnserve
