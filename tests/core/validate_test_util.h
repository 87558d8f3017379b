// Shared pieces of the validation tests (validate_prefill_test.cc,
// validate_kv_merge_test.cc): a small geometry, request limits and filler
// bytes.
#pragma once

#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/validate.h"

namespace attnserve {
namespace validate_test {

using ::testing::HasSubstr;

inline constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
inline constexpr uint64_t kIncarnation = 0x1234567890abcdefull;

inline KvGeometry Geo(int32_t page_size = 16) {
  KvGeometry g;
  g.num_layers = 2;
  g.num_pages = 10;
  g.page_size = page_size;
  g.num_qo_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.dtype = KvDType::kBf16;
  return g;
}

inline RequestLimits Limits() {
  RequestLimits l;
  l.max_message_bytes = 1 << 20;
  l.max_request_rows = 64;
  l.max_request_kv_indices = 32;
  return l;
}

inline std::string Bytes(int64_t n) { return std::string(static_cast<size_t>(n), '\x3c'); }

}  // namespace validate_test
}  // namespace attnserve
