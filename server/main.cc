// attnserve: the GPU-resident attention server. Its flags are server/flags.cc's,
// read once into StartOptions; this starts the backend, the core and the
// listeners from them and serves until a signal drains it.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define ATTNSERVE_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ATTNSERVE_LSAN 1
#endif
#endif
#ifdef ATTNSERVE_LSAN
#include <sanitizer/lsan_interface.h>
#endif

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/transport.h"
#include "common/usage.h"
#include "spdlog/spdlog.h"
#include "kernels/plan/kernel_select.h"
#include "server/backend/factory.h"
#include "server/core/attention_core.h"
#include "server/flags.h"
#include "server/grpc/auth.h"
#include "server/grpc/server.h"
#include "server/library_logs.h"
#include "server/metrics.h"

namespace attnserve {
namespace {

// Exit status of a backend or listener that cannot start, a watchdog or a
// second signal; a flag error exits kExitUsage (2). docs/operations.md, "Exit
// codes".
constexpr int kExitRuntime = 1;

// The exit status of a server that failed to start with `status`: a flag's
// value at fault (a file it names cannot be read, values that contradict
// each other) exits 2, anything else 1.
int StartExitCode(const absl::Status& status) {
  return absl::IsInvalidArgument(status) || absl::IsNotFound(status) ? kExitUsage : kExitRuntime;
}

// Ends the process now: the drain has answered every RPC, and what is left
// (a batch still running on an abandoned request, civetweb's and gRPC's
// teardown) must not hold the exit past --drain_timeout_s. Objects still
// alive are reachable from this stack, so the leak checker of sanitizer
// builds still sees real leaks only.
[[noreturn]] void ExitNow(int code) {
  spdlog::default_logger()->flush();
  std::fflush(stdout);
  std::fflush(stderr);
#ifdef ATTNSERVE_LSAN
  __lsan_do_leak_check();
#endif
  std::_Exit(code);
}
int Run() {
  // protobuf's and gRPC's own log lines go through ours, at most one a
  // second per cause (a malformed request repeated must not flood the log);
  // gRPC's at debug level: the server's own message says what failed.
  RouteLibraryLogs();
  absl::StatusOr<StartOptions> start = StartOptionsFromFlags();
  if (!start.ok()) {
    spdlog::error("{}", std::string(start.status().message()));
    return kExitUsage;
  }
  const spdlog::level::level_enum level = spdlog::level::from_str(start->log_level);
  // Until the "listening" line, info too: the start and listening lines are
  // printed at every level (docs/operations.md, "Life cycle").
  spdlog::set_level(std::min(level, spdlog::level::info));
  if (start->retain_freed_memory && !RetainFreedMemory()) {
    spdlog::info("--retain_freed_memory: the allocator did not take the setting (not glibc's "
                 "malloc); freed memory goes back as the allocator decides");
  }
  // Signals are taken by one thread with sigwait; block them everywhere else.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  const KvGeometry& geometry = start->geometry;
  const CoreOptions& core_options = start->core;
  const BackendOptions& backend_options = start->backend;
  ServerOptions& server_options = start->server;
  if (core_options.regions.enabled) {
    // Each system region keeps a descriptor (its holder connection): take
    // the hard limit on descriptors rather than a distribution's low soft one.
    rlimit files{};
    if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
      files.rlim_cur = files.rlim_max;
      setrlimit(RLIMIT_NOFILE, &files);
    }
  }

  auto backend = MakeBackend(backend_options);
  if (!backend.ok()) {
    spdlog::error("backend: {}", backend.status().ToString());
    // This build has no CUDA backend, or the backend does not take the
    // geometry the flags give (INVALID_ARGUMENT): the flags are at fault,
    // not the machine.
    return absl::IsUnimplemented(backend.status()) || absl::IsInvalidArgument(backend.status())
               ? kExitUsage
               : kExitRuntime;
  }
  // The CPU backend runs its reference kernels: a CUDA kernel family asked
  // for is not silently ignored.
  if ((*backend)->Name() == "cpu" && backend_options.prefill_family != PrefillFamily::kAuto) {
    spdlog::error(
        "--prefill_kernel={} selects a CUDA kernel family, but the backend is cpu{}: the cpu "
        "backend runs its reference kernels; leave --prefill_kernel at auto",
        start->prefill_kernel, backend_options.kind == "auto" ? " (--backend=auto found no GPU)" : "");
    return backend_options.kind == "cpu" ? kExitUsage : kExitRuntime;
  }
  auto auth = TokenAuth::Load(start->auth_tokens_file);
  if (!auth.ok()) {
    spdlog::error("{}", auth.status().ToString());
    return kExitUsage;
  }

  Metrics metrics;
  metrics.AddTenants((*auth)->Tenants());
  // The page table and the core's other per-page state: the flags may ask
  // for more than the host has.
  std::unique_ptr<AttentionCore> core;
  try {
    core = std::make_unique<AttentionCore>(core_options, *std::move(backend), &metrics);
  } catch (const std::bad_alloc&) {
    spdlog::error("cannot allocate the server's state for {} KV pages (--num_pages or --kv_cache_bytes): "
                  "out of host memory",
                  geometry.num_pages);
    return kExitRuntime;
  }
  server_options.reflection = start->reflection == "on" || (start->reflection == "auto" && !(*auth)->enabled());
  auto server = AttnServer::Start(server_options, core.get(), auth->get(), &metrics);
  if (!server.ok()) {
    spdlog::error("{}", server.status().ToString());
    return StartExitCode(server.status());
  }
  AttnServer* server_ptr = server->get();
  core->SetFaultHandler([server_ptr](const absl::Status& status) {
    spdlog::error("backend fault, health set to NOT_SERVING: {}", status.ToString());
    server_ptr->SetNotServing();
  });
  const ServerInfoData info = core->Info();
  // The prefill kernel family the CUDA backend picks from; the CPU backend
  // runs its reference kernels whatever the flag says.
  const std::string family = info.backend == "cuda" ? PrefillFamilyName(backend_options.prefill_family) : "cpu";
  const std::string q_name = geometry.dtype == KvDType::kBf16 ? "bf16" : "fp16";
  const std::string kv_name = geometry.KvIsFp8() ? Fp8FormatName(geometry.kv_fp8) : q_name;
  metrics.SetBuildInfo(info.version, kGitCommit, info.backend, info.device, family, kv_name,
                       q_name);
  const int64_t kv_cache_bytes = info.kv_cache_bytes;
  spdlog::info(
      "attnserve {} (commit {}) started: pid={} backend={} device=\"{}\" layers={} pages={} "
      "page_size={} attention={} qo_heads={} kv_heads={} head_dim={} v_head_dim={} kv_dtype={} "
      "q_dtype={} kv_cache_bytes={} ({:.1f} MiB) page_bytes={} prefill_kernel={} auth={} tls={} "
      "shared_memory={} check_kv_written={}",
      info.version, kGitCommit, getpid(), info.backend, info.device, info.num_layers,
      info.num_pages, info.page_size, AttentionKindName(info.attention), info.num_qo_heads,
      info.num_kv_heads, info.head_dim, info.v_head_dim, kv_name, q_name, kv_cache_bytes, kv_cache_bytes / 1048576.0, info.page_bytes, family,
      (*auth)->enabled() ? "on" : "off", server_options.tls_cert.empty() ? "off" : "on",
      core_options.regions.enabled ? "on" : "off", core_options.check_kv_written ? "on" : "off");
  // Tests and scripts read this line to find the ports.
  spdlog::info("listening grpc={} metrics={} region_socket={}", (*server)->grpc_address(),
               (*server)->metrics_address().empty() ? "off" : (*server)->metrics_address(),
               (*server)->region_socket().empty() ? "off" : (*server)->region_socket());
  spdlog::set_level(level);

  absl::Notification drained;
  int abandoned = 0;
  const absl::Duration drain_timeout = start->drain_timeout;
  std::thread signal_thread([&] {
    bool draining = false;
    for (;;) {
      int sig = 0;
      if (sigwait(&signals, &sig) != 0) continue;
      if (sig == SIGHUP) {
        absl::Status s = (*auth)->Reload();
        if (s.ok()) {
          metrics.AddTenants((*auth)->Tenants());
          spdlog::info("SIGHUP: reloaded --auth_tokens_file");
        } else {
          spdlog::error("SIGHUP: keeping the old tokens: {}", s.ToString());
        }
        continue;
      }
      if (draining) {
        // A repeated SIGTERM (a supervisor that sends it again) keeps the
        // drain going; a second SIGINT (Ctrl-C twice at a terminal) means
        // "now".
        if (sig == SIGTERM) {
          spdlog::info("signal {} again: already draining", sig);
          continue;
        }
        spdlog::warn("second SIGINT: exiting at once");
        std::_Exit(kExitRuntime);
      }
      draining = true;
      spdlog::info("signal {}: draining (up to {})", sig, absl::FormatDuration(drain_timeout));
      std::thread([&] {
        abandoned = (*server)->Drain(drain_timeout);
        drained.Notify();
      }).detach();
      // The drain bounds itself; this bounds whatever it waits on.
      std::thread([drain_timeout] {
        absl::SleepFor(drain_timeout + absl::Seconds(1));
        spdlog::error("shutdown overran --drain_timeout_s + 1 s: exiting now");
        ExitNow(kExitRuntime);
      }).detach();
    }
  });
  signal_thread.detach();
  (*server)->Wait();
  drained.WaitForNotification();
  if (abandoned > 0) {
    spdlog::warn("attnserve stopped: {} requests were still running at the drain deadline and "
                 "were answered UNAVAILABLE",
                 abandoned);
  } else {
    spdlog::info("attnserve stopped");
  }
  ExitNow(0);
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  const std::vector<char*> args = attnserve::ParseCommandLine(
      argc, argv,
      {"attnserve",
       "attnserve [flags]: the GPU-resident paged attention server (CUDA backend, or the CPU\n"
       "reference backend). Flags, ports, metrics and signals: docs/operations.md.",
       {{attnserve::kServerFlagsSource, "Flags"}}});
  // The server takes flags only: a stray word is a flag mistyped
  // ("num_pages=5") or given after "--".
  if (args.size() > 1) {
    spdlog::error("unexpected argument '{}': attnserve takes only --flags (see --help)", args[1]);
    return attnserve::kExitUsage;
  }
  return attnserve::Run();
}
