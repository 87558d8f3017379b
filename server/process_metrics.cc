#include "server/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace attnserve {
namespace {

void Add(std::vector<prometheus::MetricFamily>* families, const char* name, const char* help,
         prometheus::MetricType type, double value) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(metric);
  families->push_back(std::move(family));
}

std::string ReadAll(const char* path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// /proc/stat's btime: when the system booted, Unix seconds.
bool BootTime(double* seconds) {
  std::ifstream in("/proc/stat");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "btime ")) {
      return absl::SimpleAtod(absl::string_view(line).substr(6), seconds);
    }
  }
  return false;
}

// Entries of /proc/self/fd (the descriptor opendir holds included, as
// client_golang counts them).
bool OpenFds(double* count) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return false;
  int64_t n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  *count = static_cast<double>(n);
  return true;
}

}  // namespace

void AppendProcessMetrics(std::vector<prometheus::MetricFamily>* families) {
  using prometheus::MetricType;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page_bytes = static_cast<double>(sysconf(_SC_PAGESIZE));
  // /proc/self/stat: "pid (comm) state ppid ...": the fields after the last
  // ')' start with field 3 (state). utime 14, stime 15, starttime 22,
  // vsize 23, rss 24 (proc(5)).
  const std::string stat = ReadAll("/proc/self/stat");
  const size_t paren = stat.rfind(')');
  std::vector<absl::string_view> f;
  if (paren != std::string::npos) {
    f = absl::StrSplit(absl::string_view(stat).substr(paren + 1), ' ', absl::SkipEmpty());
  }
  auto field = [&f](size_t n, double* value) {
    return n - 3 < f.size() && absl::SimpleAtod(f[n - 3], value);
  };
  double utime = 0, stime = 0, start = 0, vsize = 0, rss = 0, boot = 0, fds = 0;
  if (field(14, &utime) && field(15, &stime)) {
    Add(families, "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
        MetricType::Counter, (utime + stime) / ticks);
  }
  if (field(23, &vsize)) {
    Add(families, "process_virtual_memory_bytes", "Virtual memory size in bytes.",
        MetricType::Gauge, vsize);
  }
  if (field(24, &rss)) {
    Add(families, "process_resident_memory_bytes", "Resident memory size in bytes.",
        MetricType::Gauge, rss * page_bytes);
  }
  if (field(22, &start) && BootTime(&boot)) {
    Add(families, "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.", MetricType::Gauge,
        boot + start / ticks);
  }
  if (OpenFds(&fds)) {
    Add(families, "process_open_fds", "Number of open file descriptors.", MetricType::Gauge, fds);
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    Add(families, "process_max_fds", "Maximum number of open file descriptors.",
        MetricType::Gauge, static_cast<double>(limit.rlim_cur));
  }
}

}  // namespace attnserve
