#include "client/bench_stats.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/host_port.h"

namespace attnserve {

void LatencyStats::Record(double latency_s, const absl::Status& status, bool wrong, int64_t rows,
                          double flops) {
  absl::MutexLock lock(&mu_);
  ++done_;
  if (!status.ok()) {
    ++errors_[absl::StatusCodeToString(status.code())];
    return;
  }
  if (wrong) ++wrong_;
  ++ok_;
  rows_ += rows;
  flops_ += flops;
  latencies_.push_back(latency_s);
}

void LatencyStats::Dropped() {
  absl::MutexLock lock(&mu_);
  ++dropped_;
}

int64_t LatencyStats::done() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

int64_t LatencyStats::Snapshot::Errors() const {
  int64_t n = wrong;
  for (const auto& [code, count] : errors) n += count;
  return n;
}

double LatencyStats::Snapshot::Percentile(double p) const {
  if (sorted.empty()) return 0;
  const size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * sorted.size()));
  return sorted[std::min(sorted.size() - 1, rank == 0 ? 0 : rank - 1)];
}

LatencyStats::Snapshot LatencyStats::Take(bool with_samples) const {
  Snapshot s;
  absl::MutexLock lock(&mu_);
  s.done = done_, s.ok = ok_, s.wrong = wrong_, s.dropped = dropped_, s.rows = rows_;
  s.flops = flops_;
  s.errors = errors_;
  s.sorted = latencies_;
  if (with_samples) {
    const size_t stride = (latencies_.size() + kMaxSamples - 1) / kMaxSamples;
    for (size_t i = 0; i < latencies_.size(); i += std::max<size_t>(stride, 1)) {
      s.samples.push_back(latencies_[i]);
    }
  }
  std::sort(s.sorted.begin(), s.sorted.end());
  return s;
}

std::string FormatMs(double seconds) { return absl::StrFormat("%.3f", seconds * 1e3); }

absl::StatusOr<std::string> FetchMetrics(const std::string& address) {
  const std::optional<HostPort> hp = SplitHostPort(address);
  if (!hp || hp->host.empty() || hp->port.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': want HOST:PORT"));
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(hp->host.c_str(), hp->port.c_str(), &hints, &res) != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", address));
  }
  const int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  const bool connected = fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0;
  freeaddrinfo(res);
  if (!connected) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to ", address));
  }
  const std::string request = absl::StrCat("GET /metrics HTTP/1.0\r\nHost: ", address, "\r\n\r\n");
  std::string response;
  const bool sent =
      send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size());
  char buf[65536];
  for (ssize_t n; sent && (n = recv(fd, buf, sizeof(buf), 0)) > 0;) response.append(buf, n);
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (!sent || body == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("no HTTP response from ", address));
  }
  const absl::string_view status_line =
      absl::string_view(response).substr(0, response.find("\r\n"));
  if (!absl::StrContains(status_line, " 200")) {
    return absl::InternalError(
        absl::StrCat("GET http://", address, "/metrics answered '", status_line, "'"));
  }
  return response.substr(body + 4);
}

absl::StatusOr<double> SumMetric(absl::string_view text, absl::string_view name,
                                 absl::string_view label, absl::string_view exclude) {
  double sum = 0;
  bool found = false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::ConsumePrefix(&line, name)) continue;
    absl::string_view labels;
    if (absl::ConsumePrefix(&line, "{")) {
      const size_t close = line.find('}');
      if (close == absl::string_view::npos) continue;
      labels = line.substr(0, close);
      line.remove_prefix(close + 1);
    }
    if (!absl::ConsumePrefix(&line, " ")) continue;  // a longer name with this prefix
    if (!label.empty() && !absl::StrContains(labels, label)) continue;
    if (!exclude.empty() && absl::StrContains(labels, exclude)) continue;
    // The value, then an optional timestamp.
    const absl::string_view value = line.substr(0, line.find(' '));
    double v;
    if (!absl::SimpleAtod(value, &v)) continue;
    sum += v;
    found = true;
  }
  if (!found) return absl::NotFoundError(absl::StrCat("no sample of ", name, " in /metrics"));
  return sum;
}

}  // namespace attnserve
