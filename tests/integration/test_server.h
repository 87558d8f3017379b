// TestServer: runs the real attnserve binary as a child process for the
// integration tests.
//
// It starts build/bin/attnserve (ATTNSERVE_BIN) on 127.0.0.1:0 for gRPC and
// metrics with the CPU backend, reads the child's output for the line
// `listening grpc=HOST:PORT metrics=HOST:PORT` to learn the ports, then
// waits on the gRPC health check (wait-for-ready, no sleeps) until SERVING.
// The destructor sends SIGTERM and reaps the child.
//
//   TestServerOptions options;
//   options.page_size = 16;
//   auto server = TestServer::Start(options);
//   auto client = Client::Connect({.target = (*server)->grpc_address()});
//   ...
//   EXPECT_EQ((*server)->Stop(), 0);  // exited cleanly
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnserve {

struct TestServerOptions {
  int32_t num_layers = 2;
  int32_t num_pages = 256;
  int32_t page_size = 16;
  int32_t num_qo_heads = 8;
  int32_t num_kv_heads = 2;
  int32_t head_dim = 64;
  std::string kv_dtype = "bf16";
  // > 0: an MLA server (--attention=mla with these latent sizes; num_kv_heads
  // and head_dim are not passed).
  int32_t kv_lora_rank = 0;
  int32_t qk_rope_head_dim = 0;
  std::vector<std::string> extra_flags;  // e.g. "--auth_tokens_file=/tmp/x"
  double start_timeout_s = 60;
};

class TestServer {
 public:
  static absl::StatusOr<std::unique_ptr<TestServer>> Start(const TestServerOptions& options);
  // Stops `old` (expecting a clean exit) and starts a server of `options` on
  // its gRPC address: a restart, as clients of that address see it.
  static absl::StatusOr<std::unique_ptr<TestServer>> RestartOn(TestServer& old, TestServerOptions options);
  ~TestServer();

  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& metrics_address() const { return metrics_address_; }
  const TestServerOptions& options() const { return options_; }
  pid_t pid() const { return pid_; }

  // True while the child has not exited.
  bool Alive();
  // SIGTERM, then waits for the child. Returns its exit code, or 128 + the
  // signal that killed it. Later calls return the same value.
  int Stop();
  // Waits for the child to exit (after a signal the test sent itself), with
  // Stop's return value.
  int Wait() { return WaitForExit(/*signal_first=*/false); }
  // Everything the child has written to stdout and stderr so far.
  std::string Output() const;

 private:
  TestServer() = default;
  void ReadOutput();
  int WaitForExit(bool signal_first);

  TestServerOptions options_;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int exit_code_ = -1;
  std::string grpc_address_;
  std::string metrics_address_;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string output_ ABSL_GUARDED_BY(mu_);
};

// Runs `call` (returning an absl::Status or an absl::StatusOr) until it stops
// failing with UNAVAILABLE (a channel reconnecting to a restarted server),
// for up to 30 s; returns its last result.
inline const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}
template <typename F>
auto RetryWhileUnavailable(F call) -> decltype(call()) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  auto r = call();
  while (absl::IsUnavailable(StatusOf(r)) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    r = call();
  }
  return r;
}

// Plain HTTP/1.0 GET of http://address/path; returns the body (200 only).
absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path);

// The value of the Prometheus sample `name{labels}` in an exposition text;
// labels is the exact text between the braces ("" for none). NOT_FOUND when
// absent.
absl::StatusOr<double> MetricValue(const std::string& text, const std::string& name,
                                   const std::string& labels = "");

// A new --auth_tokens_file (TOKEN TENANT lines) in the test's temporary
// directory ($TEST_TMPDIR, else /tmp) holding `contents`; returns its path.
// It is unlinked when the test program exits, if the caller has not done so.
absl::StatusOr<std::string> WriteTokensFile(const std::string& contents);

// Runs a program with arguments, waits, and returns its exit code (128 +
// signal when killed) with its combined stdout and stderr in *output.
int RunProgram(const std::vector<std::string>& argv, std::string* output);

}  // namespace attnserve
