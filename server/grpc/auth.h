// Bearer-token authentication at the gRPC edge.
//
// --auth_tokens_file holds one "TOKEN TENANT" pair per line ('#' starts a
// comment). Clients send the metadata "authorization: Bearer TOKEN". Without
// a file every caller is the tenant "default". Tokens never reach logs.
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

inline constexpr char kDefaultTenant[] = "default";

class TokenAuth {
 public:
  // Empty path: authentication off.
  static absl::StatusOr<std::unique_ptr<TokenAuth>> Load(const std::string& path);

  // Re-reads the file (e.g. on SIGHUP); on error keeps the old tokens.
  absl::Status Reload();

  // The tenant of an "authorization" metadata value, or UNAUTHENTICATED.
  absl::StatusOr<std::string> Authenticate(absl::string_view authorization) const;

  bool enabled() const { return !path_.empty(); }

  // The tenants the tokens name, sorted; without a file, "default".
  std::vector<std::string> Tenants() const;

 private:
  static absl::StatusOr<absl::flat_hash_map<std::string, std::string>> Parse(
      const std::string& path);

  std::string path_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> tenants_ ABSL_GUARDED_BY(mu_);  // token -> tenant
};

}  // namespace attnserve
