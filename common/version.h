// attnserve's version and the commit it was built from: for --version, the
// server's start line and ServerInfo.version.
//
// Both come from the generated attnserve/version.h (CMake's project(VERSION)
// and git at configure time). Only common/version.cc includes that header,
// so that a new commit recompiles one file.
#pragma once

namespace attnserve {

// "MAJOR.MINOR.PATCH", e.g. "0.2.0".
extern const char kVersion[];
// Short git hash of the source the build came from, or "unknown".
extern const char kGitCommit[];

}  // namespace attnserve
