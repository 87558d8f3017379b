#include "server/grpc/auth.h"

#include <algorithm>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/flag_file.h"

namespace attnserve {

absl::StatusOr<absl::flat_hash_map<std::string, std::string>> TokenAuth::Parse(
    const std::string& path) {
  auto text_or = ReadFlagFile("--auth_tokens_file", path);
  if (!text_or.ok()) return text_or.status();
  // A leading UTF-8 byte-order mark (editors on some systems write one)
  // is not part of the first token.
  absl::string_view text_all = *text_or;
  absl::ConsumePrefix(&text_all, "\xEF\xBB\xBF");
  std::istringstream in{std::string(text_all)};
  absl::flat_hash_map<std::string, std::string> tenants;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    absl::string_view text = line;
    if (auto hash = text.find('#'); hash != absl::string_view::npos) text = text.substr(0, hash);
    std::vector<absl::string_view> fields =
        absl::StrSplit(text, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("--auth_tokens_file=", path, " line ",
                                                     line_no, ": expected 'TOKEN TENANT'"));
    }
    // A token listed twice would silently act for the last tenant named.
    auto [it, added] = tenants.emplace(std::string(fields[0]), std::string(fields[1]));
    if (!added) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth_tokens_file=", path, " line ", line_no, ": the token is listed before (for tenant '",
          it->second, "'): each token names one tenant"));
    }
  }
  // No token at all (an empty file, or one truncated while it is rewritten)
  // would refuse every call of every tenant.
  if (tenants.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--auth_tokens_file=", path,
        " holds no token: every call would be refused (one 'TOKEN TENANT' line per token; without the "
        "flag every caller is tenant 'default')"));
  }
  return tenants;
}

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::Load(const std::string& path) {
  auto auth = std::make_unique<TokenAuth>();
  auth->path_ = path;
  if (!path.empty()) {
    auto tenants = Parse(path);
    if (!tenants.ok()) return tenants.status();
    absl::MutexLock lock(&auth->mu_);
    auth->tenants_ = *std::move(tenants);
  }
  return auth;
}

absl::Status TokenAuth::Reload() {
  if (path_.empty()) return absl::OkStatus();
  auto tenants = Parse(path_);
  if (!tenants.ok()) return tenants.status();
  absl::MutexLock lock(&mu_);
  tenants_ = *std::move(tenants);
  return absl::OkStatus();
}

std::vector<std::string> TokenAuth::Tenants() const {
  if (path_.empty()) return {kDefaultTenant};
  std::vector<std::string> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [token, tenant] : tenants_) out.push_back(tenant);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

absl::StatusOr<std::string> TokenAuth::Authenticate(absl::string_view authorization) const {
  if (path_.empty()) return std::string(kDefaultTenant);
  // The scheme is case-insensitive (RFC 7235): "bearer TOKEN" is a token too.
  constexpr absl::string_view kBearer = "Bearer ";
  if (authorization.empty()) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer TOKEN' metadata");
  }
  if (!absl::StartsWithIgnoreCase(authorization, kBearer)) {
    return absl::UnauthenticatedError(
        "the 'authorization' metadata is not 'Bearer TOKEN' (another scheme, or no space after "
        "it)");
  }
  absl::string_view token = absl::StripAsciiWhitespace(authorization.substr(kBearer.size()));
  absl::MutexLock lock(&mu_);
  auto it = tenants_.find(token);
  if (it == tenants_.end()) return absl::UnauthenticatedError("unknown bearer token");
  return it->second;
}

}  // namespace attnserve
