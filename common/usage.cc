#include "common/usage.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"
#include "common/version.h"

namespace attnserve {
namespace {

// The program the command line belongs to; set once by ParseCommandLine.
const ProgramUsage* g_program = nullptr;

// True when `path` (a flag's file as compiled, often absolute) is `source`,
// a path from the repository root.
bool IsSource(absl::string_view path, absl::string_view source) {
  return path == source || absl::EndsWith(path, absl::StrCat("/", source));
}

bool IsOwnFlagFile(absl::string_view path) {
  if (g_program == nullptr) return false;
  for (const FlagSource& s : g_program->flag_sources) {
    if (IsSource(path, s.file)) return true;
  }
  return false;
}

// A file name without the directories of the machine it was built on: ours
// from the repository root, Abseil's from absl/.
std::string NormalizeFilename(absl::string_view path) {
  if (g_program != nullptr) {
    for (const FlagSource& s : g_program->flag_sources) {
      if (IsSource(path, s.file)) return s.file;
    }
  }
  const size_t absl_dir = path.rfind("absl/");
  if (absl_dir != absl::string_view::npos) return std::string(path.substr(absl_dir));
  const size_t slash = path.rfind('/');
  return std::string(slash == absl::string_view::npos ? path : path.substr(slash + 1));
}

// "--name=DEFAULT", with an empty or blank default quoted.
std::string FlagWithDefault(const absl::CommandLineFlag& flag) {
  std::string value = flag.DefaultValue();
  if (value.empty() || absl::StrContains(value, ' ')) value = absl::StrCat("\"", value, "\"");
  return absl::StrCat("--", flag.Name(), "=", value);
}

// One line per flag, sorted by name, meanings aligned at `column`.
void AppendSection(std::string* out, absl::string_view title,
                   std::vector<const absl::CommandLineFlag*> flags, size_t column) {
  if (flags.empty()) return;
  std::sort(flags.begin(), flags.end(),
            [](const absl::CommandLineFlag* a, const absl::CommandLineFlag* b) {
              return a->Name() < b->Name();
            });
  absl::StrAppend(out, "\n", title, ":\n");
  for (const absl::CommandLineFlag* flag : flags) {
    const std::string left = FlagWithDefault(*flag);
    const size_t pad = left.size() + 2 < column ? column - left.size() : 2;
    absl::StrAppend(out, "  ", left, std::string(pad, ' '), flag->Help(), "\n");
  }
}

// Abseil's parser prints what is wrong with a command line (an unknown flag,
// a value that does not parse) and exits 1; attnserve's programs exit 2 on
// every flag error (docs/operations.md, "Exit codes"). While it parses, an
// exit handler turns that exit into 2.
std::atomic<bool> g_parsing{false};

void ExitTwoWhileParsing() {
  if (!g_parsing.load()) return;
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(kExitUsage);
}

bool IsArg(absl::string_view arg, std::initializer_list<absl::string_view> names) {
  for (absl::string_view name : names) {
    if (arg == name) return true;
  }
  return false;
}

}  // namespace

std::string VersionLine(const std::string& name) {
  return absl::StrCat(name, " ", kVersion, " (commit ", kGitCommit, ")");
}

std::string HelpText(const ProgramUsage& program, bool full) {
  // Each flag goes to the first section whose file defines it; the rest are
  // shown with --helpfull only.
  std::vector<std::vector<const absl::CommandLineFlag*>> sections(program.flag_sources.size());
  std::vector<const absl::CommandLineFlag*> others;
  size_t widest = 0;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const std::string file = flag->Filename();
    size_t section = 0;
    while (section < program.flag_sources.size() &&
           !IsSource(file, program.flag_sources[section].file)) {
      ++section;
    }
    if (section < program.flag_sources.size()) {
      sections[section].push_back(flag);
    } else if (full) {
      others.push_back(flag);
    } else {
      continue;
    }
    widest = std::max(widest, FlagWithDefault(*flag).size());
  }
  const size_t column = std::min<size_t>(widest, 40) + 2;

  std::string out = absl::StrCat(VersionLine(program.name), "\n\n", program.usage, "\n");
  for (size_t i = 0; i < sections.size(); ++i) {
    AppendSection(&out, program.flag_sources[i].title, sections[i], column);
  }
  if (full) {
    AppendSection(&out, "Built-in flags (Abseil's)", others, column);
  } else {
    absl::StrAppend(&out,
                    "\nAlso: --flagfile=PATH (one --flag=value per line), --helpfull (every flag, "
                    "Abseil's built-in ones too), --version.\n");
  }
  return out;
}

std::vector<char*> ParseCommandLine(int argc, char** argv, const ProgramUsage& program) {
  g_program = new ProgramUsage(program);  // lives as long as the process
  absl::SetProgramUsageMessage(program.usage);
  // For what Abseil still prints itself (--helpon, --helpmatch, errors): the
  // same flags and version, and no build paths.
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = IsOwnFlagFile;
  config.contains_help_flags = IsOwnFlagFile;
  config.contains_helppackage_flags = IsOwnFlagFile;
  config.version_string = [] { return VersionLine(g_program->name) + "\n"; };
  config.normalize_filename = NormalizeFilename;
  absl::SetFlagsUsageConfig(config);

  // Abseil exits 1 after --help and lists only flags of a file named after
  // the program; these are answered here instead, before any parsing.
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--") break;
    const bool help = IsArg(arg, {"-h", "-help", "--help", "-helpshort", "--helpshort"});
    const bool helpfull = IsArg(arg, {"-helpfull", "--helpfull"});
    const bool version = IsArg(arg, {"-version", "--version"});
    if (!help && !helpfull && !version) continue;
    std::cout << (version ? VersionLine(program.name) + "\n" : HelpText(program, helpfull))
              << std::flush;
    std::exit(0);
  }
  // Abseil answers its other usage flags (--helpon, --helpmatch, ...) itself
  // and exits 0 or 1 on purpose: its status stays for those.
  bool usage_flag = false;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = absl::StripPrefix(absl::StripPrefix(argv[i], "-"), "-");
    if (absl::StartsWith(arg, "help") || absl::StartsWith(arg, "only_check_args")) usage_flag = true;
  }
  // Abseil reads a --flagfile that names a directory as an empty file, so
  // that a mount path given instead of the file in it would start the
  // program on its defaults. (Only the command line's: a --flagfile named
  // inside a flagfile is Abseil's alone.)
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    arg = absl::StripPrefix(absl::StripPrefix(arg, "-"), "-");
    absl::string_view files;
    if (absl::ConsumePrefix(&arg, "flagfile=")) {
      files = arg;
    } else if (arg == "flagfile" && i + 1 < argc) {
      files = argv[i + 1];
    } else {
      continue;
    }
    for (absl::string_view file : absl::StrSplit(files, ',', absl::SkipEmpty())) {
      struct stat st {};
      if (stat(std::string(file).c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
        std::cerr << "--flagfile=" << file << ": a directory, not a file (name the file in it)\n";
        std::exit(kExitUsage);
      }
    }
  }
  std::atexit(ExitTwoWhileParsing);
  g_parsing = !usage_flag;
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  g_parsing = false;
  return args;
}

}  // namespace attnserve
