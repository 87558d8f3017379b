// tcp_echo: the raw TCP floor under attnecho. A client and a server thread
// in one process talk over a loopback (or any) TCP connection with no gRPC,
// no HTTP/2 and no protobuf: each round trip sends a 16-byte header (request
// and response sizes) and `in` bytes, and the server answers with `out`
// bytes. Buffers are allocated and touched once, so what is measured is the
// kernel's socket path and memory bandwidth: the best any RPC stack on this
// host can do for the same byte counts.
//
//   tcp_echo                                  # decode64 and 128 MiB cases
//   tcp_echo --cases=524288:532480 --iterations=2000
//   tcp_echo --listen=0.0.0.0:50070           # server only
//   tcp_echo --connect=HOST:50070             # client only, against it
//
// Prints one line per case: p50, p99 and mean round-trip milliseconds and
// the bytes moved per second (in + out over the mean round trip).
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/host_port.h"
#include "common/usage.h"

ABSL_FLAG(std::string, cases, "524288:532480,134217728:134283264",
          "IN:OUT byte counts per round trip, comma-separated (default: decode64's 512 KiB "
          "query / 520 KiB output+LSE, and a 16k-row prefill's 128 MiB / 128 MiB + LSE)");
ABSL_FLAG(int32_t, iterations, 0,
          "round trips per case after warm-up; 0: 2000 for cases under 16 MiB, 30 above");
ABSL_FLAG(int32_t, warmup, 0, "round trips before measuring; 0: iterations / 10 (at least 2)");
ABSL_FLAG(std::string, listen, "", "server only: listen on HOST:PORT and serve until killed");
ABSL_FLAG(std::string, connect, "",
          "client only: connect to HOST:PORT (a tcp_echo --listen); default: an in-process "
          "server on 127.0.0.1");
ABSL_FLAG(int32_t, socket_buffer_bytes, 0,
          "SO_SNDBUF / SO_RCVBUF on both ends; 0: the kernel's autotuning");

namespace {

// The largest IN or OUT of a case (--cases), on both ends.
constexpr uint64_t kMaxCaseBytes = uint64_t{1} << 30;

// A case's byte counts, IN:OUT.
struct Case {
  uint64_t in = 0, out = 0;
};

// --cases, or an error naming the entry and the bound.
std::vector<Case> ParseCases(std::string* error) {
  std::vector<Case> cases;
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_cases), ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> io = absl::StrSplit(c, ':');
    Case k;
    if (io.size() != 2 || !absl::SimpleAtoi(io[0], &k.in) || !absl::SimpleAtoi(io[1], &k.out) ||
        k.in > kMaxCaseBytes || k.out > kMaxCaseBytes) {
      *error = "--cases entry '" + std::string(c) + "' is not IN:OUT, each a byte count in [0, " +
               std::to_string(kMaxCaseBytes) + "]";
      return {};
    }
    cases.push_back(k);
  }
  if (cases.empty()) *error = "--cases is empty: give at least one IN:OUT";
  return cases;
}

// The flag errors (exit 2), or "".
std::string CheckFlags() {
  if (!absl::GetFlag(FLAGS_listen).empty() && !absl::GetFlag(FLAGS_connect).empty()) {
    return "--listen (server only) and --connect (client only) exclude each other";
  }
  for (const auto& [name, v] : {std::pair{"--iterations", absl::GetFlag(FLAGS_iterations)},
                                std::pair{"--warmup", absl::GetFlag(FLAGS_warmup)},
                                std::pair{"--socket_buffer_bytes", absl::GetFlag(FLAGS_socket_buffer_bytes)}}) {
    if (v < 0) return std::string(name) + "=" + std::to_string(v) + " must be >= 0 (0: the default)";
  }
  std::string error;
  if (absl::GetFlag(FLAGS_listen).empty()) ParseCases(&error);
  return error;
}

[[noreturn]] void Die(const std::string& what) {
  std::perror(what.c_str());
  std::exit(1);
}

bool SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool RecvAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t r = recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void Tune(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  const int bytes = absl::GetFlag(FLAGS_socket_buffer_bytes);
  if (bytes > 0) {
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  }
}

// Splits HOST:PORT (exit 2 if it is not).
attnserve::HostPort HostPortOf(const std::string& address) {
  const std::optional<attnserve::HostPort> hp = attnserve::SplitHostPort(address);
  if (!hp) {
    std::fprintf(stderr, "tcp_echo: %s is not HOST:PORT\n", address.c_str());
    std::exit(2);
  }
  return *hp;
}

// Serves one connection: header (in, out), `in` bytes in, `out` bytes back.
void ServeConnection(int fd) {
  Tune(fd);
  std::vector<char> in, out;
  for (;;) {
    uint64_t sizes[2];
    if (!RecvAll(fd, reinterpret_cast<char*>(sizes), sizeof(sizes))) break;
    if (sizes[0] > kMaxCaseBytes || sizes[1] > kMaxCaseBytes) break;  // not a tcp_echo client
    if (in.size() < sizes[0]) in.resize(sizes[0], 1);
    if (out.size() < sizes[1]) out.resize(sizes[1], 2);
    if (!RecvAll(fd, in.data(), sizes[0])) break;
    if (!SendAll(fd, out.data(), sizes[1])) break;
  }
  close(fd);
}

int Listen(const std::string& address, int* port) {
  auto [host, port_s] = HostPortOf(address);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* ai = nullptr;
  if (getaddrinfo(host.c_str(), port_s.c_str(), &hints, &ai) != 0) Die("getaddrinfo");
  const int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) Die("bind " + address);
  freeaddrinfo(ai);
  if (listen(fd, 16) != 0) Die("listen");
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  *port = ntohs(bound.sin_port);
  return fd;
}

void ServeForever(int listen_fd) {
  for (;;) {
    const int fd = accept(listen_fd, nullptr, nullptr);
    if (fd < 0) {
      if (errno == EINTR) continue;
      return;
    }
    std::thread(ServeConnection, fd).detach();
  }
}

int Connect(const std::string& address) {
  auto [host, port] = HostPortOf(address);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* ai = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &ai) != 0) Die("getaddrinfo");
  const int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) Die("connect " + address);
  freeaddrinfo(ai);
  Tune(fd);
  return fd;
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

}  // namespace

int main(int argc, char** argv) {
  attnserve::ParseCommandLine(
      argc, argv,
      {"tcp_echo",
       "tcp_echo [flags]: round trips of raw bytes over one TCP connection (no gRPC): the floor "
       "under attnecho for the same byte counts.",
       {{"bench/tcp_echo.cc", "Flags"}}});
  if (const std::string bad = CheckFlags(); !bad.empty()) {
    std::fprintf(stderr, "tcp_echo: %s\n", bad.c_str());
    return 2;
  }
  if (!absl::GetFlag(FLAGS_listen).empty()) {
    int port = 0;
    const int fd = Listen(absl::GetFlag(FLAGS_listen), &port);
    std::printf("tcp_echo listening port=%d\n", port);
    std::fflush(stdout);
    ServeForever(fd);
    return 0;
  }
  std::string target = absl::GetFlag(FLAGS_connect);
  if (target.empty()) {
    int port = 0;
    const int listen_fd = Listen("127.0.0.1:0", &port);
    std::thread(ServeForever, listen_fd).detach();
    target = "127.0.0.1:" + std::to_string(port);
  }
  const int fd = Connect(target);
  std::printf("| in bytes | out bytes | iterations | p50 ms | p99 ms | mean ms | GB/s (in+out) |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  std::string unused;
  for (const Case& c : ParseCases(&unused)) {  // (checked: CheckFlags)
    uint64_t sizes[2] = {c.in, c.out};
    int iterations = absl::GetFlag(FLAGS_iterations);
    if (iterations <= 0) iterations = sizes[0] + sizes[1] < (32u << 20) ? 2000 : 30;
    int warmup = absl::GetFlag(FLAGS_warmup);
    if (warmup <= 0) warmup = std::max(2, iterations / 10);
    std::vector<char> in(sizes[0], 3), out(sizes[1], 4);
    std::vector<double> ms;
    ms.reserve(iterations);
    for (int i = 0; i < warmup + iterations; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      if (!SendAll(fd, reinterpret_cast<char*>(sizes), sizeof(sizes)) ||
          !SendAll(fd, in.data(), in.size()) || !RecvAll(fd, out.data(), out.size())) {
        Die("round trip");
      }
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    double mean = 0;
    for (double x : ms) mean += x;
    mean /= static_cast<double>(ms.size());
    std::printf("| %llu | %llu | %d | %.3f | %.3f | %.3f | %.2f |\n",
                static_cast<unsigned long long>(sizes[0]),
                static_cast<unsigned long long>(sizes[1]), iterations, Percentile(ms, 0.5),
                Percentile(ms, 0.99), mean,
                static_cast<double>(sizes[0] + sizes[1]) / (mean * 1e-3) / 1e9);
    std::fflush(stdout);
  }
  close(fd);
  return 0;
}
