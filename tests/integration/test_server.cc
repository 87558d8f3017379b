#include "tests/integration/test_server.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

#ifndef ATTNSERVE_BIN
#error "ATTNSERVE_BIN must name the attnserve binary"
#endif

namespace attnserve {
namespace {

constexpr char kListeningLine[] = "listening grpc=";

int ExitCodeOf(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

// Forks and execs argv with stdout and stderr on a new pipe; returns the pid
// and the pipe's read end. The child dies with the test process.
absl::Status Spawn(const std::vector<std::string>& args, pid_t* pid, int* out_fd) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", errno));
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t child = fork();
  if (child < 0) return absl::InternalError(absl::StrCat("fork: ", errno));
  if (child == 0) {
    // Only async-signal-safe calls between fork and exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  *pid = child;
  *out_fd = fds[0];
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TestServer>> TestServer::Start(const TestServerOptions& options) {
  std::unique_ptr<TestServer> s(new TestServer());
  s->options_ = options;
  // $ATTNSERVE_BIN overrides the path the tests were built with (an
  // installed tree on another machine: bench/run_ipc_gpu.sh).
  const char* bin = std::getenv("ATTNSERVE_BIN");
  std::vector<std::string> args = {
      bin != nullptr && *bin != '\0' ? bin : ATTNSERVE_BIN,
      "--listen=127.0.0.1:0",
      "--metrics_listen=127.0.0.1:0",
      "--backend=cpu",
      absl::StrCat("--num_layers=", options.num_layers),
      absl::StrCat("--num_pages=", options.num_pages),
      absl::StrCat("--page_size=", options.page_size),
      absl::StrCat("--num_qo_heads=", options.num_qo_heads),
      absl::StrCat("--kv_dtype=", options.kv_dtype),
      "--drain_timeout_s=10",
  };
  if (options.kv_lora_rank > 0) {
    args.push_back("--attention=mla");
    args.push_back(absl::StrCat("--kv_lora_rank=", options.kv_lora_rank));
    args.push_back(absl::StrCat("--qk_rope_head_dim=", options.qk_rope_head_dim));
  } else {
    args.push_back(absl::StrCat("--num_kv_heads=", options.num_kv_heads));
    args.push_back(absl::StrCat("--head_dim=", options.head_dim));
  }
  args.insert(args.end(), options.extra_flags.begin(), options.extra_flags.end());
  // $ATTNSERVE_TEST_SERVER_FLAGS (space-separated) come last, so a run can
  // repeat a suite with another server setting (bench/run_server_gpu.sh runs
  // the GPU server tests once more with --prefill_kernel=sm90).
  if (const char* more = std::getenv("ATTNSERVE_TEST_SERVER_FLAGS"); more != nullptr) {
    for (absl::string_view f : absl::StrSplit(more, ' ', absl::SkipEmpty())) args.emplace_back(f);
  }
  absl::Status spawned = Spawn(args, &s->pid_, &s->out_fd_);
  if (!spawned.ok()) return spawned;

  // Read the child's output up to the line that names the ports.
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(options.start_timeout_s * 1e3));
  std::string seen;
  size_t line_at = std::string::npos;
  while ((line_at = seen.find(kListeningLine)) == std::string::npos ||
         seen.find('\n', line_at) == std::string::npos) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("attnserve printed no 'listening' line; its output:\n", seen));
    }
    pollfd pfd{s->out_fd_, POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(s->out_fd_, buf, sizeof(buf));
    if (n <= 0) {
      return absl::UnavailableError(
          absl::StrCat("attnserve exited before listening (exit ", s->Stop(), "); its output:\n",
                       seen));
    }
    seen.append(buf, n);
  }
  const std::string line =
      seen.substr(line_at + strlen(kListeningLine), seen.find('\n', line_at) - line_at -
                                                        strlen(kListeningLine));
  // line: "HOST:PORT metrics=HOST:PORT"
  std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipWhitespace());
  if (parts.size() < 2 || !absl::StartsWith(parts[1], "metrics=")) {
    return absl::InternalError(absl::StrCat("cannot parse the listening line: ", line));
  }
  s->grpc_address_ = parts[0];
  s->metrics_address_ = std::string(absl::StripPrefix(parts[1], "metrics="));
  {
    absl::MutexLock lock(&s->mu_);
    s->output_ = seen;
  }
  s->reader_ = std::thread([server = s.get()] { server->ReadOutput(); });

  // Ready when the health check says SERVING; wait_for_ready makes the call
  // wait for the connection instead of failing fast.
  auto channel = grpc::CreateChannel(s->grpc_address_, grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_wait_for_ready(true);
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::system_clock::duration>(
                         deadline - std::chrono::steady_clock::now()));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status status = health->Check(&ctx, req, &resp);
    if (status.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) break;
    if (!s->Alive() || std::chrono::steady_clock::now() >= deadline) {
      return absl::UnavailableError(absl::StrCat("attnserve never became SERVING (",
                                                 status.error_message(), "); its output:\n",
                                                 s->Output()));
    }
  }
  return s;
}

void TestServer::ReadOutput() {
  char buf[4096];
  for (;;) {
    const ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    absl::MutexLock lock(&mu_);
    output_.append(buf, n);
  }
}

std::string TestServer::Output() const {
  absl::MutexLock lock(&mu_);
  return output_;
}

bool TestServer::Alive() {
  if (exit_code_ >= 0) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    exit_code_ = ExitCodeOf(status);
    return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<TestServer>> TestServer::RestartOn(TestServer& old, TestServerOptions options) {
  const std::string address = old.grpc_address();
  if (const int code = old.Stop(); code != 0) {
    return absl::InternalError(absl::StrCat("the server on ", address, " exited ", code, " at its stop"));
  }
  options.extra_flags.push_back(absl::StrCat("--listen=", address));
  return Start(options);
}

int TestServer::Stop() { return WaitForExit(/*signal_first=*/true); }

int TestServer::WaitForExit(bool signal_first) {
  if (pid_ > 0 && Alive()) {
    if (signal_first) kill(pid_, SIGTERM);
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    exit_code_ = ExitCodeOf(status);
  }
  if (reader_.joinable()) reader_.join();
  if (out_fd_ >= 0) {
    close(out_fd_);
    out_fd_ = -1;
  }
  return exit_code_;
}

TestServer::~TestServer() { Stop(); }

absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return absl::InvalidArgumentError("address needs host:port");
  const std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", address));
  }
  const int fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC, res->ai_protocol);
  if (fd < 0) {
    freeaddrinfo(res);
    return absl::InternalError("socket");
  }
  timeval timeout{30, 0};  // a hung endpoint fails the test instead of hanging it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  const int connected = connect(fd, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  if (connected != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to ", address));
  }
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", address, "\r\nConnection: close\r\n\r\n");
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("send");
  }
  std::string response;
  char buf[8192];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    response.append(buf, n);
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (body == std::string::npos || status_line.find(" 200") == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("GET ", path, ": ", status_line));
  }
  return response.substr(body + 4);
}

absl::StatusOr<double> MetricValue(const std::string& text, const std::string& name,
                                   const std::string& labels) {
  auto sorted = [](absl::string_view l) {
    std::vector<std::string> v = absl::StrSplit(l, ',', absl::SkipEmpty());
    std::sort(v.begin(), v.end());
    return v;
  };
  const std::vector<std::string> want = sorted(labels);
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#' || !absl::ConsumePrefix(&line, name)) continue;
    std::vector<std::string> have;
    if (!line.empty() && line[0] == '{') {
      const size_t close = line.find('}');
      if (close == absl::string_view::npos) continue;
      have = sorted(line.substr(1, close - 1));
      line.remove_prefix(close + 1);
    }
    if (line.empty() || line[0] != ' ' || have != want) continue;
    double value;
    if (absl::SimpleAtod(absl::StripAsciiWhitespace(line), &value)) return value;
  }
  return absl::NotFoundError(absl::StrCat(name, "{", labels, "} not in the metrics"));
}

int RunProgram(const std::vector<std::string>& argv, std::string* output) {
  pid_t pid;
  int fd;
  if (!Spawn(argv, &pid, &fd).ok()) return -1;
  output->clear();
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    output->append(buf, n);
  }
  close(fd);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return ExitCodeOf(status);
}

namespace {

// Tokens files not yet removed, unlinked when the test program exits (a
// caller that stops at a failed assertion leaves its file to this).
class TokensFiles {
 public:
  ~TokensFiles() {
    for (const std::string& path : paths_) unlink(path.c_str());
  }
  void Add(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    paths_.push_back(path);
  }

 private:
  std::mutex mu_;
  std::vector<std::string> paths_;
};

TokensFiles& TokensFilesToRemove() {
  static TokensFiles files;
  return files;
}

}  // namespace

absl::StatusOr<std::string> WriteTokensFile(const std::string& contents) {
  const char* dir = std::getenv("TEST_TMPDIR");
  std::string path = absl::StrCat(dir != nullptr && *dir != '\0' ? dir : "/tmp", "/attnserve_tokens_XXXXXX");
  const int fd = mkstemp(path.data());
  if (fd < 0) return absl::InternalError(absl::StrCat("mkstemp ", path, ": ", std::strerror(errno)));
  const ssize_t n = write(fd, contents.data(), contents.size());
  close(fd);
  if (n != static_cast<ssize_t>(contents.size())) {
    unlink(path.c_str());
    return absl::InternalError(absl::StrCat("writing ", path, ": ", std::strerror(errno)));
  }
  TokensFilesToRemove().Add(path);
  return path;
}

}  // namespace attnserve
