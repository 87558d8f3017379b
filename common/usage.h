// --help and --version for attnserve's programs (attnserve, attnctl,
// attnbench, attnecho). The flag list comes from Abseil's flag registry, so
// the help text cannot drift from the flags themselves.
//
//   int main(int argc, char** argv) {
//     std::vector<char*> args = attnserve::ParseCommandLine(argc, argv, {
//         "attnctl", "attnctl [flags] COMMAND\n...",
//         {{"client/attnctl.cc", "Flags"}, {"client/cli_flags.cc", "Connection flags"}}});
//     ...
//
// --help (also -h, -help, --helpshort) prints the usage and then the flags
// defined in the program's own source files, one per line:
// `--name=DEFAULT  meaning`. --helpfull adds every other flag linked in
// (Abseil's). --version prints "NAME VERSION (commit HASH)". Each exits 0
// before the program runs. Everything else is absl::ParseCommandLine's,
// except its exit status: a command line it cannot parse (an unknown flag, a
// value that does not parse) exits kExitUsage (2), as every other flag error
// of these programs does.
#pragma once

#include <string>
#include <vector>

namespace attnserve {

// Exit status of a flag error (unknown flag, malformed or out-of-range value,
// a file a flag names that cannot be read): docs/operations.md, "Exit codes".
inline constexpr int kExitUsage = 2;

// Flags defined in one source file, shown under one heading.
struct FlagSource {
  std::string file;   // path from the repository root, e.g. "client/cli_flags.cc"
  std::string title;  // e.g. "Connection flags"
};

struct ProgramUsage {
  std::string name;                      // "attnctl"
  std::string usage;                     // synopsis and a sentence or two
  std::vector<FlagSource> flag_sources;  // the program's own flags, in order
};

// Handles --help, --helpfull and --version (printing to stdout and exiting 0),
// then parses the command line with absl::ParseCommandLine and returns the
// positional arguments (argv[0] first).
std::vector<char*> ParseCommandLine(int argc, char** argv, const ProgramUsage& program);

// The text --help (full = false) or --helpfull (full = true) prints.
std::string HelpText(const ProgramUsage& program, bool full);

// "NAME VERSION (commit HASH)".
std::string VersionLine(const std::string& name);

}  // namespace attnserve
