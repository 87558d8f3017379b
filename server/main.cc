// attnserve: the GPU-resident attention server. Flags are defined here only
// and read once into the options structs of the layers below.
#include <sys/resource.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <optional>
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

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/transport.h"
#include "common/usage.h"
#include "grpc/support/log.h"
#include "spdlog/spdlog.h"
#include "kernels/plan/kernel_select.h"
#include "server/backend/factory.h"
#include "server/core/attention_core.h"
#include "server/grpc/auth.h"
#include "server/grpc/server.h"
#include "server/library_logs.h"
#include "server/metrics.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "gRPC address (host:port; port 0 picks one)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics address (host:port; empty turns it off)");
ABSL_FLAG(std::string, backend, "auto", "auto (CUDA when a GPU is present), cuda or cpu");
ABSL_FLAG(std::string, decode_kernel, "auto",
          "CUDA: auto (sequences of 1..8 query rows run on the decode kernel family) or off (everything on "
          "the prefill family, for A/B comparisons)");
ABSL_FLAG(int32_t, device, 0, "CUDA device ordinal");
ABSL_FLAG(int32_t, num_layers, 4, "layers of KV cache");
ABSL_FLAG(int32_t, num_pages, 1024, "KV pages (shared by all layers); see --kv_cache_bytes");
ABSL_FLAG(int64_t, kv_cache_bytes, 0,
          "when > 0, size the KV cache (K and V, all layers) to this many bytes instead of "
          "--num_pages");
ABSL_FLAG(int32_t, page_size, 16, "tokens per page (1..128)");
ABSL_FLAG(int32_t, num_qo_heads, 32, "query heads");
ABSL_FLAG(int32_t, num_kv_heads, 4, "KV heads (must divide num_qo_heads)");
ABSL_FLAG(int32_t, head_dim, 128, "head dimension (64, 128 or 256)");
ABSL_FLAG(std::string, attention, "gqa",
          "gqa (K and V rows of --num_kv_heads x --head_dim) or mla (multi-head latent attention: "
          "one latent row of --kv_lora_rank + --qk_rope_head_dim values per token, shared by every "
          "query head; --num_kv_heads and --head_dim do not apply; the CUDA backend takes 512 + 64, "
          "16-bit; other widths run on --backend=cpu)");
ABSL_FLAG(int32_t, kv_lora_rank, 512,
          "--attention=mla: the latent width, which is also the value and output width "
          "(a multiple of 16 in [16, 1024])");
ABSL_FLAG(int32_t, qk_rope_head_dim, 64,
          "--attention=mla: the rope part of each latent row and query "
          "(a multiple of 16 in [0, 256])");
ABSL_FLAG(std::string, kv_dtype, "bf16",
          "what the KV cache holds: bf16 or fp16 (also the queries' dtype), or fp8_e4m3 or "
          "fp8_e5m2 (one byte an element: twice the pages in the same --kv_cache_bytes; "
          "queries stay --q_dtype)");
ABSL_FLAG(std::string, q_dtype, "",
          "queries and outputs: bf16 or fp16; empty: --kv_dtype when that is bf16 or fp16, "
          "else bf16. A 16-bit --kv_dtype must equal it");
ABSL_FLAG(std::string, prefill_kernel, "auto",
          "CUDA prefill kernel family: auto (the heuristic's choice for the device), sm80 (mma.sync) "
          "or sm90 (wgmma; Hopper GPUs only, head_dim 64 and 128)");
ABSL_FLAG(int32_t, max_batch_tokens, 16384, "query rows per batch (a larger request runs alone)");
ABSL_FLAG(int64_t, max_queue_delay_us, 1000,
          "most microseconds a batch waits for more requests while the device is busy");
ABSL_FLAG(int64_t, idle_spin_us, 0,
          "microseconds the batch worker polls for the next request when its queue runs empty, "
          "before it sleeps (0..1000000; saves a thread wake-up per request at the cost of a "
          "busy core while requests keep coming)");
ABSL_FLAG(bool, scrub_freed_pages, true,
          "zero a freed page's KV before it can be allocated again (off only when every "
          "client is trusted with every other's data)");
ABSL_FLAG(bool, check_kv_written, true,
          "refuse (FAILED_PRECONDITION) a Prefill that reads KV rows not written since their "
          "page was allocated, instead of attending over zeros");
ABSL_FLAG(int32_t, max_queue_requests, 4096, "queued requests before RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_message_bytes, 512ll << 20, "largest request or response in bytes");
ABSL_FLAG(int32_t, tenant_max_pages, 0, "most pages one tenant may hold (0: no cap)");
ABSL_FLAG(std::string, auth_tokens_file, "", "file of 'TOKEN TENANT' lines; empty: no auth");
ABSL_FLAG(std::string, tls_cert, "", "PEM server certificate (TLS)");
ABSL_FLAG(std::string, tls_key, "", "PEM server key (TLS)");
ABSL_FLAG(std::string, tls_client_ca, "", "PEM CA for client certificates (mTLS)");
ABSL_FLAG(int32_t, drain_timeout_s, 30, "seconds in-flight requests get after SIGTERM");
ABSL_FLAG(int32_t, max_streams_per_connection, 256,
          "concurrent calls one gRPC connection may carry (1..65536)");
ABSL_FLAG(int64_t, connection_idle_timeout_s, 300,
          "a connection with no call for this many seconds is closed (clients reconnect on "
          "their next call)");
ABSL_FLAG(int64_t, keepalive_s, 60,
          "the server pings a connection idle this many seconds and closes it when the ping "
          "goes unanswered for 20 s (a peer that vanished)");
ABSL_FLAG(int64_t, handshake_timeout_s, 10,
          "a new connection must finish its TLS and HTTP/2 handshake within this many seconds");
ABSL_FLAG(int64_t, request_read_timeout_s, 60,
          "an authenticated call's request must have arrived this many seconds after the call "
          "began, or the call ends with DEADLINE_EXCEEDED (a slow or stalled sender)");
ABSL_FLAG(std::string, log_level, "info",
          "trace, debug, info, warn, error (debug also shows gRPC's own log lines)");
ABSL_FLAG(bool, access_log, false, "log one line per RPC (method, tenant, code, seconds)");
ABSL_FLAG(int32_t, max_plans_per_tenant, 64,
          "step plans (CreatePlan) one tenant may hold at once");
ABSL_FLAG(int64_t, max_plan_bytes_per_tenant, int64_t{1} << 30,
          "bytes of server memory one tenant's step plans may hold in all (a plan keeps its "
          "layout's arrays: about 16 bytes a kv index)");
ABSL_FLAG(int64_t, plan_idle_timeout_s, 300,
          "seconds after which an unused plan is released (its pages unpinned)");
ABSL_FLAG(int64_t, lease_default_ttl_s, 30,
          "time-to-live of a lease (GrantLease) that asks for none: what a client holds under "
          "it is released this long after its last renewal");
ABSL_FLAG(int64_t, lease_max_ttl_s, 3600, "longest time-to-live GrantLease gives (1..86400)");
ABSL_FLAG(int32_t, max_leases_per_tenant, 1024, "leases one tenant may hold at once");
ABSL_FLAG(std::string, reflection, "auto",
          "serve gRPC server reflection: on, off, or auto (on only without --auth_tokens_file: "
          "reflection answers without a token)");
ABSL_FLAG(bool, allow_shared_memory, false,
          "serve RegisterRegion: clients on this host may name shared-memory regions (sealed "
          "memfds sent over --region_socket, CUDA IPC) instead of sending tensor bytes; trusts "
          "them as docs/transport.md says");
ABSL_FLAG(std::string, region_socket, "",
          "with --allow_shared_memory: the Unix socket on which clients on this host send the "
          "memfds of system regions, '@NAME' (abstract namespace) or a path; empty: "
          "@attnserve-PORT, PORT the bound gRPC port (ServerInfo.region_socket tells clients)");
ABSL_FLAG(int32_t, max_regions_per_tenant, 16, "shared-memory regions one tenant may hold");
ABSL_FLAG(int64_t, max_region_bytes_per_tenant, int64_t{64} << 30,
          "bytes of shared-memory regions one tenant may hold");
ABSL_FLAG(int32_t, max_channels_per_tenant, 4,
          "request channels (OpenChannel) one tenant may hold open; each has a poller thread");
ABSL_FLAG(int64_t, channel_spin_us, 200,
          "microseconds a request channel's poller spins after the last request before it sleeps "
          "on the ring's futex (0..1000000; one busy core per channel while it spins)");
ABSL_FLAG(bool, transport_tuning, true,
          "gRPC HTTP/2 and TCP settings for large tensors (docs/transport.md); false: gRPC's "
          "defaults (for A/B measurements)");
ABSL_FLAG(std::string, grpc_args, "",
          "extra gRPC channel arguments NAME=INT,... applied after --transport_tuning's "
          "(experiments)");
ABSL_FLAG(bool, retain_freed_memory, true,
          "keep memory freed by malloc for the next message instead of returning it to the "
          "kernel (up to 1 GiB per malloc arena; docs/transport.md); false: glibc's defaults");
ABSL_FLAG(int32_t, max_tenant_queue_requests, 0,
          "queued requests of one tenant before RESOURCE_EXHAUSTED (0: --max_queue_requests)");
ABSL_FLAG(int64_t, max_queue_bytes, int64_t{8} << 30,
          "bytes of server memory queued and running requests may hold (their messages and "
          "responses) before RESOURCE_EXHAUSTED; a request is taken whatever its size when none "
          "is held (at least 1 MiB)");
ABSL_FLAG(int64_t, max_tenant_queue_bytes, 0,
          "bytes of server memory one tenant's queued and running requests may hold before "
          "RESOURCE_EXHAUSTED (0: --max_queue_bytes)");

namespace attnserve {
namespace {

// A flag the command line (or a --flagfile) gave, whatever its value (a
// value equal to the default contradicts --attention=mla as much as any).
// Abseil keeps CommandLineFlag::IsSpecifiedOnCommandLine private in the
// packaged version; its parser's record of the same is this.
bool FlagChanged(absl::string_view name) { return absl::flags_internal::WasPresentOnCommandLine(name); }

// --attention and, for MLA, its latent sizes: num_kv_heads 1 and head_dim
// kv_lora_rank + qk_rope_head_dim.
absl::Status ApplyAttentionFlags(KvGeometry* g) {
  const std::string attention = absl::GetFlag(FLAGS_attention);
  if (attention == "gqa") {
    for (const char* name : {"kv_lora_rank", "qk_rope_head_dim"}) {
      if (FlagChanged(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, " applies to --attention=mla only"));
      }
    }
    return absl::OkStatus();
  }
  if (attention != "mla") {
    return absl::InvalidArgumentError(
        absl::StrCat("--attention=", attention, " must be gqa or mla"));
  }
  g->attention = AttentionKind::kMla;
  g->kv_lora_rank = absl::GetFlag(FLAGS_kv_lora_rank);
  g->qk_rope_head_dim = absl::GetFlag(FLAGS_qk_rope_head_dim);
  if (!IsSupportedKvLoraRank(g->kv_lora_rank)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_lora_rank=", g->kv_lora_rank, " must be a multiple of 16 in [16, 1024]"));
  }
  if (!IsSupportedRopeDim(g->qk_rope_head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--qk_rope_head_dim=", g->qk_rope_head_dim, " must be a multiple of 16 in [0, 256]"));
  }
  const int32_t width = g->kv_lora_rank + g->qk_rope_head_dim;
  if (FlagChanged("num_kv_heads") && g->num_kv_heads != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_kv_heads=", g->num_kv_heads,
        " with --attention=mla: MLA has one latent KV head (leave the flag out)"));
  }
  if (FlagChanged("head_dim") && g->head_dim != width) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--head_dim=", g->head_dim, " with --attention=mla: the query and key width is "
        "--kv_lora_rank + --qk_rope_head_dim = ", width, " (leave the flag out)"));
  }
  g->num_kv_heads = 1;
  g->head_dim = width;
  return absl::OkStatus();
}

absl::StatusOr<KvGeometry> GeometryFromFlags() {
  KvGeometry g;
  g.num_layers = absl::GetFlag(FLAGS_num_layers);
  g.page_size = absl::GetFlag(FLAGS_page_size);
  g.num_qo_heads = absl::GetFlag(FLAGS_num_qo_heads);
  g.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  g.head_dim = absl::GetFlag(FLAGS_head_dim);
  if (absl::Status s = ApplyAttentionFlags(&g); !s.ok()) return s;
  const std::string dtype = absl::GetFlag(FLAGS_kv_dtype);
  const std::string q_dtype = absl::GetFlag(FLAGS_q_dtype);
  if (!q_dtype.empty() && q_dtype != "bf16" && q_dtype != "fp16") {
    return absl::InvalidArgumentError(absl::StrCat("--q_dtype=", q_dtype, " must be bf16 or fp16"));
  }
  if (dtype == "bf16" || dtype == "fp16") {
    g.dtype = dtype == "bf16" ? KvDType::kBf16 : KvDType::kFp16;
    if (!q_dtype.empty() && q_dtype != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--q_dtype=", q_dtype, " contradicts --kv_dtype=", dtype,
          ": a 16-bit KV cache holds the queries' dtype (a different --q_dtype needs "
          "--kv_dtype=fp8_e4m3 or fp8_e5m2)"));
    }
  } else if (dtype == "fp8_e4m3" || dtype == "fp8_e5m2") {
    g.kv_fp8 = dtype == "fp8_e4m3" ? Fp8Format::kE4m3 : Fp8Format::kE5m2;
    if (q_dtype.empty() || q_dtype == "bf16") {
      g.dtype = KvDType::kBf16;
    } else if (q_dtype == "fp16") {
      g.dtype = KvDType::kFp16;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--q_dtype=", q_dtype, " must be bf16 or fp16"));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_dtype=", dtype, " must be bf16, fp16, fp8_e4m3 or fp8_e5m2"));
  }
  if (g.num_layers < 1 || g.num_layers > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("--num_layers=", g.num_layers, " out of range [1, 1024]"));
  }
  if (g.page_size < 1 || g.page_size > 128) {
    return absl::InvalidArgumentError(absl::StrCat("--page_size=", g.page_size, " out of range [1, 128]"));
  }
  if (!g.IsMla() && !IsSupportedHeadDim(g.head_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--head_dim=", g.head_dim, " must be ", kSupportedHeadDims));
  }
  if (g.IsMla() && g.KvIsFp8()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_dtype=", dtype, " with --attention=mla: an MLA cache is bf16 or fp16 so far"));
  }
  if (g.num_kv_heads < 1 || g.num_kv_heads > 256) {
    return absl::InvalidArgumentError(absl::StrCat("--num_kv_heads=", g.num_kv_heads, " out of range [1, 256]"));
  }
  if (g.num_qo_heads < 1 || g.num_qo_heads > 256 ||
      g.num_qo_heads % g.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_qo_heads=", g.num_qo_heads, " must be in [1, 256] and a multiple of --num_kv_heads=",
        g.num_kv_heads));
  }
  const int64_t cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  int64_t pages = absl::GetFlag(FLAGS_num_pages);
  if (cache_bytes > 0) pages = cache_bytes / BytesPerPage(g);
  if (pages < 1 || pages > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV pages=", pages, " out of range [1, ", INT32_MAX, "] (--num_pages or --kv_cache_bytes / ",
        BytesPerPage(g), " bytes per page)"));
  }
  // Each flag within its range can still multiply past what a byte count
  // holds: the cache is bounded at 1 PiB, far above any device.
  constexpr int64_t kMaxCacheBytes = int64_t{1} << 50;
  if (pages > kMaxCacheBytes / BytesPerPage(g)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_pages=", pages, " pages of ", BytesPerPage(g),
        " bytes (--num_layers x --page_size x --num_kv_heads x --head_dim x K and V) exceed the cache's "
        "bound of 2^50 bytes: use fewer pages or --kv_cache_bytes"));
  }
  g.num_pages = static_cast<int32_t>(pages);
  return g;
}

// Exit status of a backend or listener that cannot start, a watchdog or a
// second signal; a flag error exits kExitUsage (2). docs/operations.md, "Exit
// codes".
constexpr int kExitRuntime = 1;

// HOST:PORT split at its last colon; HOST without the brackets of an IPv6
// literal. Nothing without a colon.
struct HostPort {
  std::string host;
  std::string port;
};
std::optional<HostPort> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  HostPort hp{address.substr(0, colon), address.substr(colon + 1)};
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  }
  return hp;
}

// A --listen or --metrics_listen value: HOST:PORT with PORT in [0, 65535]
// and a HOST that resolves. gRPC and civetweb would only say that they
// cannot listen there.
absl::Status CheckListenAddress(absl::string_view flag, const std::string& address) {
  const std::optional<HostPort> hp = SplitHostPort(address);
  int port = -1;
  if (!hp || !absl::SimpleAtoi(hp->port, &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, "=", address, ": not HOST:PORT (e.g. 127.0.0.1:50051, 0.0.0.0:50051, [::]:50051; "
        "port 0 picks a free one)"));
  }
  const std::string& host = hp->host;
  if (host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, "=", address, ": no host (0.0.0.0:", port, " listens on every IPv4 address, [::]:", port,
        " on every address)"));
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", address, ": host '", host,
                                                   "' does not resolve (", gai_strerror(rc), ")"));
  }
  freeaddrinfo(found);
  return absl::OkStatus();
}

// --listen and --metrics_listen (both passed CheckListenAddress) on one
// port (not 0) of one host, or of every host: the second to bind would fail
// with no word of why.
absl::Status CheckDistinctAddresses(const std::string& listen, const std::string& metrics) {
  const HostPort grpc = *SplitHostPort(listen);
  const HostPort metric = *SplitHostPort(metrics);
  auto every = [](const std::string& h) { return h == "0.0.0.0" || h == "::"; };
  if (grpc.port == metric.port && grpc.port != "0" &&
      (grpc.host == metric.host || every(grpc.host) || every(metric.host))) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics_listen=", metrics, " and --listen=", listen,
                                                   " name the same port: give the metrics endpoint another"));
  }
  return absl::OkStatus();
}

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
  const std::string log_level = absl::GetFlag(FLAGS_log_level);
  // The five documented names only (spdlog also takes "off", which would hide
  // the "listening" line that scripts read, and "critical").
  if (log_level != "trace" && log_level != "debug" && log_level != "info" && log_level != "warn" &&
      log_level != "error") {
    spdlog::error("--log_level={} must be trace, debug, info, warn or error", log_level);
    return kExitUsage;
  }
  const spdlog::level::level_enum level = spdlog::level::from_str(log_level);
  // Until the "listening" line, info too: the start and listening lines are
  // printed at every level (docs/operations.md, "Life cycle").
  spdlog::set_level(std::min(level, spdlog::level::info));
  if (absl::GetFlag(FLAGS_retain_freed_memory) && !RetainFreedMemory()) {
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

  auto geometry = GeometryFromFlags();
  if (!geometry.ok()) {
    spdlog::error("{}", geometry.status().ToString());
    return kExitUsage;
  }
  CoreOptions core_options;
  core_options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  core_options.max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  core_options.idle_spin_us = absl::GetFlag(FLAGS_idle_spin_us);
  if (core_options.idle_spin_us < 0 || core_options.idle_spin_us > 1000000) {
    spdlog::error("--idle_spin_us={} must be in [0, 1000000]", core_options.idle_spin_us);
    return kExitUsage;
  }
  core_options.scrub_freed_pages = absl::GetFlag(FLAGS_scrub_freed_pages);
  core_options.check_kv_written = absl::GetFlag(FLAGS_check_kv_written);
  core_options.max_queue_requests = absl::GetFlag(FLAGS_max_queue_requests);
  core_options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  core_options.tenant_max_pages = absl::GetFlag(FLAGS_tenant_max_pages);
  core_options.max_tenant_queue_requests = absl::GetFlag(FLAGS_max_tenant_queue_requests);
  core_options.max_queue_bytes = absl::GetFlag(FLAGS_max_queue_bytes);
  core_options.max_tenant_queue_bytes = absl::GetFlag(FLAGS_max_tenant_queue_bytes);
  core_options.max_plans_per_tenant = absl::GetFlag(FLAGS_max_plans_per_tenant);
  core_options.max_plan_bytes_per_tenant = absl::GetFlag(FLAGS_max_plan_bytes_per_tenant);
  core_options.plan_idle_timeout_s = absl::GetFlag(FLAGS_plan_idle_timeout_s);
  core_options.regions.enabled = absl::GetFlag(FLAGS_allow_shared_memory);
  if (core_options.regions.enabled) {
    // Each system region keeps a descriptor (its holder connection): take
    // the hard limit on descriptors rather than a distribution's low soft one.
    rlimit files{};
    if (getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
      files.rlim_cur = files.rlim_max;
      setrlimit(RLIMIT_NOFILE, &files);
    }
  }
  core_options.regions.max_regions_per_tenant = absl::GetFlag(FLAGS_max_regions_per_tenant);
  core_options.regions.max_bytes_per_tenant = absl::GetFlag(FLAGS_max_region_bytes_per_tenant);
  if (core_options.regions.max_regions_per_tenant < 1 ||
      core_options.regions.max_bytes_per_tenant < 1) {
    spdlog::error("--max_regions_per_tenant and --max_region_bytes_per_tenant must be at least 1");
    return kExitUsage;
  }
  core_options.channels.max_channels_per_tenant = absl::GetFlag(FLAGS_max_channels_per_tenant);
  if (core_options.channels.max_channels_per_tenant < 1 ||
      core_options.channels.max_channels_per_tenant > 1024) {
    spdlog::error("--max_channels_per_tenant={} must be in [1, 1024]",
                  core_options.channels.max_channels_per_tenant);
    return kExitUsage;
  }
  const int64_t channel_spin_us = absl::GetFlag(FLAGS_channel_spin_us);
  if (channel_spin_us < 0 || channel_spin_us > 1000000) {
    spdlog::error("--channel_spin_us={} must be in [0, 1000000]", channel_spin_us);
    return kExitUsage;
  }
  const int64_t lease_default_ttl_s = absl::GetFlag(FLAGS_lease_default_ttl_s);
  const int64_t lease_max_ttl_s = absl::GetFlag(FLAGS_lease_max_ttl_s);
  core_options.leases.max_per_tenant = absl::GetFlag(FLAGS_max_leases_per_tenant);
  if (lease_max_ttl_s < 1 || lease_max_ttl_s > 86400) {
    spdlog::error("--lease_max_ttl_s={} must be in [1, 86400]", lease_max_ttl_s);
    return 2;
  }
  if (lease_default_ttl_s < 1 || lease_default_ttl_s > lease_max_ttl_s) {
    spdlog::error("--lease_default_ttl_s={} must be in [1, --lease_max_ttl_s={}]",
                  lease_default_ttl_s, lease_max_ttl_s);
    return 2;
  }
  if (core_options.leases.max_per_tenant < 1) {
    spdlog::error("--max_leases_per_tenant={} must be at least 1",
                  core_options.leases.max_per_tenant);
    return 2;
  }
  core_options.leases.default_ttl = absl::Seconds(lease_default_ttl_s);
  core_options.leases.max_ttl = absl::Seconds(lease_max_ttl_s);
  if (core_options.max_plans_per_tenant < 1 || core_options.plan_idle_timeout_s < 1) {
    spdlog::error("--max_plans_per_tenant and --plan_idle_timeout_s must be at least 1");
    return kExitUsage;
  }
  if (core_options.max_queue_bytes < (int64_t{1} << 20)) {
    spdlog::error("--max_queue_bytes={} must be at least 1048576 (1 MiB)",
                  core_options.max_queue_bytes);
    return kExitUsage;
  }
  if (core_options.max_plan_bytes_per_tenant < (int64_t{1} << 20)) {
    spdlog::error("--max_plan_bytes_per_tenant={} must be at least 1048576 (1 MiB)",
                  core_options.max_plan_bytes_per_tenant);
    return kExitUsage;
  }
  if (core_options.max_batch_tokens < 1 || core_options.max_message_bytes < 1024 ||
      core_options.max_message_bytes > INT32_MAX || core_options.max_queue_requests < 1) {
    spdlog::error("--max_batch_tokens >= 1, --max_queue_requests >= 1 and --max_message_bytes in "
                  "[1024, 2^31) are required");
    return kExitUsage;
  }

  for (const auto& [flag, value] :
       {std::pair<const char*, int64_t>{"--device", absl::GetFlag(FLAGS_device)},
        {"--max_queue_delay_us", core_options.max_queue_delay_us},
        {"--tenant_max_pages", core_options.tenant_max_pages},
        {"--max_tenant_queue_requests", core_options.max_tenant_queue_requests},
        {"--max_tenant_queue_bytes", core_options.max_tenant_queue_bytes},
        {"--drain_timeout_s", absl::GetFlag(FLAGS_drain_timeout_s)},
        {"--kv_cache_bytes", absl::GetFlag(FLAGS_kv_cache_bytes)}}) {
    if (value < 0) {
      spdlog::error("{}={} must be at least 0", flag, value);
      return kExitUsage;
    }
  }
  const std::string listen = absl::GetFlag(FLAGS_listen);
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  absl::Status address = CheckListenAddress("--listen", listen);
  if (address.ok() && !metrics_listen.empty()) {
    address = CheckListenAddress("--metrics_listen", metrics_listen);
    // civetweb, which serves /metrics, is built without IPv6 here.
    if (address.ok() && SplitHostPort(metrics_listen)->host.find(':') != std::string::npos) {
      address = absl::InvalidArgumentError(absl::StrCat(
          "--metrics_listen=", metrics_listen,
          ": the metrics endpoint listens on IPv4 only (e.g. 0.0.0.0:9464 or 127.0.0.1:9464)"));
    }
  }
  if (address.ok() && !metrics_listen.empty()) address = CheckDistinctAddresses(listen, metrics_listen);
  if (!address.ok()) {
    spdlog::error("{}", std::string(address.message()));
    return kExitUsage;
  }

  BackendOptions backend_options;
  const std::string prefill_kernel = absl::GetFlag(FLAGS_prefill_kernel);
  if (!ParsePrefillFamily(prefill_kernel.c_str(), &backend_options.prefill_family)) {
    spdlog::error("--prefill_kernel={} must be auto, sm80 or sm90", prefill_kernel);
    return kExitUsage;
  }
  backend_options.kind = absl::GetFlag(FLAGS_backend);
  if (backend_options.kind != "auto" && backend_options.kind != "cuda" &&
      backend_options.kind != "cpu") {
    spdlog::error("--backend={} must be auto, cuda or cpu", backend_options.kind);
    return kExitUsage;
  }
  backend_options.device = absl::GetFlag(FLAGS_device);
  const std::string decode_kernel = absl::GetFlag(FLAGS_decode_kernel);
  if (decode_kernel != "auto" && decode_kernel != "off") {
    spdlog::error("--decode_kernel={} must be auto or off", decode_kernel);
    return kExitUsage;
  }
  backend_options.decode_kernel = decode_kernel == "auto";
  backend_options.geometry = *geometry;
  backend_options.max_batch_rows = MaxRequestRows(core_options, *geometry);
  backend_options.max_batch_kv_indices = core_options.max_request_kv_indices;
  backend_options.max_batch_append_rows = backend_options.max_batch_rows;
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
        prefill_kernel, backend_options.kind == "auto" ? " (--backend=auto found no GPU)" : "");
    return backend_options.kind == "cpu" ? kExitUsage : kExitRuntime;
  }
  auto auth = TokenAuth::Load(absl::GetFlag(FLAGS_auth_tokens_file));
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
                  geometry->num_pages);
    return kExitRuntime;
  }
  ServerOptions server_options;
  server_options.listen = listen;
  server_options.metrics_listen = metrics_listen;
  server_options.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  server_options.tls_key = absl::GetFlag(FLAGS_tls_key);
  server_options.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  server_options.max_message_bytes = core_options.max_message_bytes;
  server_options.access_log = absl::GetFlag(FLAGS_access_log);
  server_options.transport_tuning = absl::GetFlag(FLAGS_transport_tuning);
  server_options.grpc_args = absl::GetFlag(FLAGS_grpc_args);
  server_options.channel_spin_us = channel_spin_us;
  {
    ServerOptions::Limits& limits = server_options.limits;
    limits.max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
    const int64_t idle = absl::GetFlag(FLAGS_connection_idle_timeout_s);
    const int64_t keepalive = absl::GetFlag(FLAGS_keepalive_s);
    const int64_t handshake = absl::GetFlag(FLAGS_handshake_timeout_s);
    const int64_t read = absl::GetFlag(FLAGS_request_read_timeout_s);
    struct Bound {
      const char* flag;
      int64_t value, lo, hi;
    };
    for (const Bound& b : {Bound{"--max_streams_per_connection", limits.max_streams_per_connection, 1, 65536},
                           Bound{"--connection_idle_timeout_s", idle, 1, 86400},
                           Bound{"--keepalive_s", keepalive, 1, 86400},
                           Bound{"--handshake_timeout_s", handshake, 1, 3600},
                           Bound{"--request_read_timeout_s", read, 1, 86400}}) {
      if (b.value < b.lo || b.value > b.hi) {
        spdlog::error("{}={} must be in [{}, {}]", b.flag, b.value, b.lo, b.hi);
        return 2;
      }
    }
    limits.connection_idle = absl::Seconds(idle);
    limits.keepalive = absl::Seconds(keepalive);
    limits.handshake_timeout = absl::Seconds(handshake);
    limits.request_read_timeout = absl::Seconds(read);
  }
  server_options.region_socket = absl::GetFlag(FLAGS_region_socket);
  if (!server_options.region_socket.empty() && !core_options.regions.enabled) {
    spdlog::error("--region_socket={} needs --allow_shared_memory (without it the server has no region socket)",
                  server_options.region_socket);
    return kExitUsage;
  }
  const std::string reflection = absl::GetFlag(FLAGS_reflection);
  if (reflection != "auto" && reflection != "on" && reflection != "off") {
    spdlog::error("--reflection={} must be auto, on or off", reflection);
    return kExitUsage;
  }
  server_options.reflection = reflection == "on" || (reflection == "auto" && !(*auth)->enabled());
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
  const std::string q_name = geometry->dtype == KvDType::kBf16 ? "bf16" : "fp16";
  const std::string kv_name = geometry->KvIsFp8() ? Fp8FormatName(geometry->kv_fp8) : q_name;
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
  const absl::Duration drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s));
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
       {{"server/main.cc", "Flags"}}});
  // The server takes flags only: a stray word is a flag mistyped
  // ("num_pages=5") or given after "--".
  if (args.size() > 1) {
    spdlog::error("unexpected argument '{}': attnserve takes only --flags (see --help)", args[1]);
    return attnserve::kExitUsage;
  }
  return attnserve::Run();
}
