#include "server/backend/scatter_list.h"

#include <algorithm>
#include <cstring>

namespace attnserve {

void CopyOut(const ScatterList& list, int64_t offset, int64_t n, void* dst) {
  if (n <= 0) return;
  // The last piece that starts at or before `offset`.
  auto it = std::upper_bound(list.pieces.begin(), list.pieces.end(), offset,
                             [](int64_t at, const ScatterPiece& p) { return at < p.offset; });
  --it;  // pieces[0].offset == 0 <= offset
  auto* out = static_cast<char*>(dst);
  for (; n > 0; ++it) {
    const int64_t skip = offset - it->offset;
    const int64_t take = std::min(n, it->size - skip);
    std::memcpy(out, it->data + skip, static_cast<size_t>(take));
    out += take;
    offset += take;
    n -= take;
  }
}

}  // namespace attnserve
