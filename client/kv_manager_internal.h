// What client/kv_manager.cc and client/kv_manager_lease.cc share. Internal
// to the client library.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attnserve {
namespace kv_manager_detail {

// The reason the manager gives when its lease is gone.
inline constexpr char kLeaseGone[] =
    "the KV manager's lease expired or was revoked: the server released its pages";

// `s` with `prefix` before its message.
inline absl::Status Prefixed(const absl::Status& s, absl::string_view prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, s.message()));
}

}  // namespace kv_manager_detail
}  // namespace attnserve
