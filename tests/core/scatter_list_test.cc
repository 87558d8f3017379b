// ScatterList (server/backend/scatter_list.h): any byte range copied out of
// pieces of random sizes equals the same range of the bytes they hold.
#include "server/backend/scatter_list.h"

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

}  // namespace
}  // namespace attnserve
