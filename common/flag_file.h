// Reading a file that a flag or option names (the server's
// --auth_tokens_file and --tls_*, the client's tls_ca, tls_cert, tls_key): the whole
// file, which must not be a directory (a regular file, a symlink to one as
// Kubernetes mounts secrets, or a pipe such as <(...) or /dev/stdin). A
// directory opens without error as an empty stream, so a mount path given
// instead of the file in it would otherwise read as an empty file.
#pragma once

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attnserve {

// NOT_FOUND when the file cannot be opened, INVALID_ARGUMENT when it is a
// directory; both name the flag ("--tls_cert") and the path.
inline absl::StatusOr<std::string> ReadFlagFile(absl::string_view flag, const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat(flag, "=", path, ": cannot open (", std::strerror(errno), ")"));
  }
  if (S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, "=", path, ": a directory, not a file (name the file in it)"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, "=", path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::NotFoundError(absl::StrCat(flag, "=", path, ": cannot read"));
  return ss.str();
}

}  // namespace attnserve
