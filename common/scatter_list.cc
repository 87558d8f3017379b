#include "common/scatter_list.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace attnserve {
namespace {

// Threads for a copy of n bytes: one below kParallelCopyMinBytes, then one
// per 4 MiB up to kMaxCopyThreads and half the host's cores (at least 2, so
// that a small host runs the split as a large one does).
constexpr int kMaxCopyThreads = 8;
int CopyThreads(int64_t n) {
  if (n < kParallelCopyMinBytes) return 1;
  const int cores = std::max(2, static_cast<int>(std::thread::hardware_concurrency()) / 2);
  return static_cast<int>(std::clamp<int64_t>(n / (int64_t{4} << 20), 1, std::min(kMaxCopyThreads, cores)));
}

// Runs copy(begin, end) over [0, n) split into CopyThreads(n) contiguous
// parts, the first on the calling thread. Threads are started per copy
// (tens of microseconds against the milliseconds of a copy this large), so
// that the client library needs no thread pool.
template <typename F>
void SplitCopy(int64_t n, F copy) {
  const int threads = CopyThreads(n);
  if (threads <= 1) {
    copy(int64_t{0}, n);
    return;
  }
  // Parts of whole 4 KiB pages, so that no two threads write one page.
  const int64_t per = ((n + threads - 1) / threads + 4095) & ~int64_t{4095};
  const auto part = [&](int i) {
    const int64_t begin = std::min(n, int64_t{i} * per);
    const int64_t end = std::min(n, begin + per);
    if (begin < end) copy(begin, end);
  };
  std::vector<std::thread> helpers;
  helpers.reserve(threads - 1);
  for (int i = 1; i < threads; ++i) helpers.emplace_back(part, i);
  part(0);
  for (std::thread& t : helpers) t.join();
}

void CopyOutSerial(const ScatterList& list, int64_t offset, int64_t n, char* out) {
  if (n <= 0) return;
  // The last piece that starts at or before `offset`.
  auto it = std::upper_bound(list.pieces.begin(), list.pieces.end(), offset,
                             [](int64_t at, const ScatterPiece& p) { return at < p.offset; });
  --it;  // pieces[0].offset == 0 <= offset
  for (; n > 0; ++it) {
    const int64_t skip = offset - it->offset;
    const int64_t take = std::min(n, it->size - skip);
    std::memcpy(out, it->data + skip, static_cast<size_t>(take));
    out += take;
    offset += take;
    n -= take;
  }
}

}  // namespace

void CopyOut(const ScatterList& list, int64_t offset, int64_t n, void* dst) {
  if (n <= 0) return;
  auto* out = static_cast<char*>(dst);
  SplitCopy(n, [&](int64_t begin, int64_t end) { CopyOutSerial(list, offset + begin, end - begin, out + begin); });
}

void CopyBytes(void* dst, const void* src, int64_t n) {
  if (n <= 0) return;
  auto* out = static_cast<char*>(dst);
  const auto* in = static_cast<const char*>(src);
  SplitCopy(n, [&](int64_t begin, int64_t end) {
    std::memcpy(out + begin, in + begin, static_cast<size_t>(end - begin));
  });
}

}  // namespace attnserve
