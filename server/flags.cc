// The server's flags (docs/operations.md, "Flags"), defined here only and
// read once into StartOptions (server/flags.h).
#include "server/flags.h"

#include <netdb.h>
#include <sys/socket.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/host_port.h"
#include "common/kv_geometry.h"
#include "common/transport.h"
#include "kernels/plan/kernel_select.h"

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
          "CUDA prefill kernel family: auto (the heuristic's choice for the device), sm80 (mma.sync), "
          "sm90 (wgmma; Hopper GPUs only, head_dim 64 and 128) or sm90_fp8q (sm90 with S = Q K^T in "
          "FP8, queries rounded to E4M3: opt-in, --kv_dtype=fp8_e4m3 or fp8_e5m2 and head_dim 128 only)");
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
          "serve gRPC server reflection: auto (on only without --auth_tokens_file: reflection "
          "answers without a token), on (not with --auth_tokens_file) or off");
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
  if (g.IsMla() && g.KvIsFp8()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_dtype=", dtype, " with --attention=mla: an MLA cache is bf16 or fp16 so far"));
  }
  if (const std::string error = GeometryShapeError(g, "--"); !error.empty()) {
    return absl::InvalidArgumentError(error);
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

// A --listen or --metrics_listen value: HOST:PORT with PORT in [0, 65535]
// and a HOST that resolves. gRPC and civetweb would only say that they
// cannot listen there.
absl::Status CheckListenAddress(absl::string_view flag, const std::string& address) {
  const std::optional<HostPort> hp = SplitHostPort(address);
  const int port = hp ? PortNumber(hp->port, 0) : -1;
  if (port < 0) {
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

absl::Status Invalid(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

// [lo, hi] or the flag's error.
absl::Status InRange(absl::string_view flag, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return Invalid(absl::StrCat(flag, "=", value, " must be in [", lo, ", ", hi, "]"));
}

absl::Status CoreFlags(CoreOptions* core) {
  core->max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  core->max_queue_delay_us = absl::GetFlag(FLAGS_max_queue_delay_us);
  core->idle_spin_us = absl::GetFlag(FLAGS_idle_spin_us);
  if (absl::Status s = InRange("--idle_spin_us", core->idle_spin_us, 0, 1000000); !s.ok()) return s;
  core->scrub_freed_pages = absl::GetFlag(FLAGS_scrub_freed_pages);
  core->check_kv_written = absl::GetFlag(FLAGS_check_kv_written);
  core->max_queue_requests = absl::GetFlag(FLAGS_max_queue_requests);
  core->max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  core->tenant_max_pages = absl::GetFlag(FLAGS_tenant_max_pages);
  core->max_tenant_queue_requests = absl::GetFlag(FLAGS_max_tenant_queue_requests);
  core->max_queue_bytes = absl::GetFlag(FLAGS_max_queue_bytes);
  core->max_tenant_queue_bytes = absl::GetFlag(FLAGS_max_tenant_queue_bytes);
  core->max_plans_per_tenant = absl::GetFlag(FLAGS_max_plans_per_tenant);
  core->max_plan_bytes_per_tenant = absl::GetFlag(FLAGS_max_plan_bytes_per_tenant);
  core->plan_idle_timeout_s = absl::GetFlag(FLAGS_plan_idle_timeout_s);
  core->regions.enabled = absl::GetFlag(FLAGS_allow_shared_memory);
  core->regions.max_regions_per_tenant = absl::GetFlag(FLAGS_max_regions_per_tenant);
  core->regions.max_bytes_per_tenant = absl::GetFlag(FLAGS_max_region_bytes_per_tenant);
  if (core->regions.max_regions_per_tenant < 1 || core->regions.max_bytes_per_tenant < 1) {
    return Invalid("--max_regions_per_tenant and --max_region_bytes_per_tenant must be at least 1");
  }
  core->channels.max_channels_per_tenant = absl::GetFlag(FLAGS_max_channels_per_tenant);
  if (absl::Status s = InRange("--max_channels_per_tenant", core->channels.max_channels_per_tenant, 1, 1024);
      !s.ok()) {
    return s;
  }
  // Read here for its bound's place in the order of errors; the server's.
  if (absl::Status s = InRange("--channel_spin_us", absl::GetFlag(FLAGS_channel_spin_us), 0, 1000000);
      !s.ok()) {
    return s;
  }
  const int64_t lease_default_ttl_s = absl::GetFlag(FLAGS_lease_default_ttl_s);
  const int64_t lease_max_ttl_s = absl::GetFlag(FLAGS_lease_max_ttl_s);
  core->leases.max_per_tenant = absl::GetFlag(FLAGS_max_leases_per_tenant);
  if (absl::Status s = InRange("--lease_max_ttl_s", lease_max_ttl_s, 1, 86400); !s.ok()) return s;
  if (lease_default_ttl_s < 1 || lease_default_ttl_s > lease_max_ttl_s) {
    return Invalid(absl::StrCat("--lease_default_ttl_s=", lease_default_ttl_s,
                                " must be in [1, --lease_max_ttl_s=", lease_max_ttl_s, "]"));
  }
  if (core->leases.max_per_tenant < 1) {
    return Invalid(absl::StrCat("--max_leases_per_tenant=", core->leases.max_per_tenant, " must be at least 1"));
  }
  core->leases.default_ttl = absl::Seconds(lease_default_ttl_s);
  core->leases.max_ttl = absl::Seconds(lease_max_ttl_s);
  if (core->max_plans_per_tenant < 1 || core->plan_idle_timeout_s < 1) {
    return Invalid("--max_plans_per_tenant and --plan_idle_timeout_s must be at least 1");
  }
  if (core->max_queue_bytes < (int64_t{1} << 20)) {
    return Invalid(absl::StrCat("--max_queue_bytes=", core->max_queue_bytes, " must be at least 1048576 (1 MiB)"));
  }
  if (core->max_plan_bytes_per_tenant < (int64_t{1} << 20)) {
    return Invalid(absl::StrCat("--max_plan_bytes_per_tenant=", core->max_plan_bytes_per_tenant,
                                " must be at least 1048576 (1 MiB)"));
  }
  if (core->max_batch_tokens < 1 || core->max_message_bytes < 1024 || core->max_message_bytes > INT32_MAX ||
      core->max_queue_requests < 1) {
    return Invalid(
        "--max_batch_tokens >= 1, --max_queue_requests >= 1 and --max_message_bytes in "
        "[1024, 2^31) are required");
  }
  for (const auto& [flag, value] :
       {std::pair<const char*, int64_t>{"--device", absl::GetFlag(FLAGS_device)},
        {"--max_queue_delay_us", core->max_queue_delay_us},
        {"--tenant_max_pages", core->tenant_max_pages},
        {"--max_tenant_queue_requests", core->max_tenant_queue_requests},
        {"--max_tenant_queue_bytes", core->max_tenant_queue_bytes},
        {"--drain_timeout_s", absl::GetFlag(FLAGS_drain_timeout_s)},
        {"--kv_cache_bytes", absl::GetFlag(FLAGS_kv_cache_bytes)}}) {
    if (value < 0) return Invalid(absl::StrCat(flag, "=", value, " must be at least 0"));
  }
  return absl::OkStatus();
}

absl::Status AddressFlags(ServerOptions* server) {
  server->listen = absl::GetFlag(FLAGS_listen);
  server->metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  const std::string& listen = server->listen;
  const std::string& metrics_listen = server->metrics_listen;
  absl::Status address = CheckListenAddress("--listen", listen);
  if (address.ok() && !metrics_listen.empty()) {
    address = CheckListenAddress("--metrics_listen", metrics_listen);
    // civetweb, which serves /metrics, is built without IPv6 here.
    if (address.ok() && SplitHostPort(metrics_listen)->host.find(':') != std::string::npos) {
      address = Invalid(absl::StrCat("--metrics_listen=", metrics_listen,
                                     ": the metrics endpoint listens on IPv4 only (e.g. 0.0.0.0:9464 or "
                                     "127.0.0.1:9464)"));
    }
  }
  if (address.ok() && !metrics_listen.empty()) address = CheckDistinctAddresses(listen, metrics_listen);
  return address;
}

absl::Status BackendFlags(const KvGeometry& geometry, const CoreOptions& core, StartOptions* start) {
  BackendOptions& backend = start->backend;
  start->prefill_kernel = absl::GetFlag(FLAGS_prefill_kernel);
  if (!ParsePrefillFamily(start->prefill_kernel.c_str(), &backend.prefill_family)) {
    return Invalid(
        absl::StrCat("--prefill_kernel=", start->prefill_kernel, " must be auto, sm80, sm90 or sm90_fp8q"));
  }
  const char* why = "";
  if (!PrefillFamilyFitsGeometry(backend.prefill_family, geometry, &why)) {
    return Invalid(absl::StrCat("--prefill_kernel=", start->prefill_kernel, " ", why));
  }
  backend.kind = absl::GetFlag(FLAGS_backend);
  if (backend.kind != "auto" && backend.kind != "cuda" && backend.kind != "cpu") {
    return Invalid(absl::StrCat("--backend=", backend.kind, " must be auto, cuda or cpu"));
  }
  backend.device = absl::GetFlag(FLAGS_device);
  const std::string decode_kernel = absl::GetFlag(FLAGS_decode_kernel);
  if (decode_kernel != "auto" && decode_kernel != "off") {
    return Invalid(absl::StrCat("--decode_kernel=", decode_kernel, " must be auto or off"));
  }
  backend.decode_kernel = decode_kernel == "auto";
  backend.geometry = geometry;
  backend.max_batch_rows = MaxRequestRows(core, geometry);
  backend.max_batch_kv_indices = core.max_request_kv_indices;
  backend.max_batch_append_rows = backend.max_batch_rows;
  return absl::OkStatus();
}

absl::Status ServerFlags(const CoreOptions& core, StartOptions* start) {
  ServerOptions& server = start->server;
  server.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  server.tls_key = absl::GetFlag(FLAGS_tls_key);
  server.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  server.max_message_bytes = core.max_message_bytes;
  server.access_log = absl::GetFlag(FLAGS_access_log);
  server.transport_tuning = absl::GetFlag(FLAGS_transport_tuning);
  server.grpc_args = absl::GetFlag(FLAGS_grpc_args);
  // Checked here, before the backend allocates the KV cache (which can take
  // a minute), rather than when the gRPC server starts.
  if (server.tls_cert.empty() != server.tls_key.empty()) {
    return Invalid("--tls_cert and --tls_key must be given together");
  }
  if (!server.tls_client_ca.empty() && server.tls_cert.empty()) {
    return Invalid("--tls_client_ca needs --tls_cert and --tls_key");
  }
  {
    std::vector<std::string> names;
    std::string error;
    ParseTransportArgs(server.grpc_args, &names, &error);
    if (!error.empty()) return Invalid(absl::StrCat("--grpc_args: ", error));
  }
  server.channel_spin_us = absl::GetFlag(FLAGS_channel_spin_us);
  ServerOptions::Limits& limits = server.limits;
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
    if (absl::Status s = InRange(b.flag, b.value, b.lo, b.hi); !s.ok()) return s;
  }
  limits.connection_idle = absl::Seconds(idle);
  limits.keepalive = absl::Seconds(keepalive);
  limits.handshake_timeout = absl::Seconds(handshake);
  limits.request_read_timeout = absl::Seconds(read);
  server.region_socket = absl::GetFlag(FLAGS_region_socket);
  if (!server.region_socket.empty() && !core.regions.enabled) {
    return Invalid(absl::StrCat("--region_socket=", server.region_socket,
                                " needs --allow_shared_memory (without it the server has no region socket)"));
  }
  start->reflection = absl::GetFlag(FLAGS_reflection);
  if (start->reflection != "auto" && start->reflection != "on" && start->reflection != "off") {
    return Invalid(absl::StrCat("--reflection=", start->reflection, " must be auto, on or off"));
  }
  if (start->reflection == "on" && !start->auth_tokens_file.empty()) {
    // gRPC's reflection service is not ours: it reads a request of any size,
    // for as long as its sender takes, from callers with no token.
    return Invalid(
        "--reflection=on with --auth_tokens_file: reflection answers callers without a token and "
        "reads their requests whole, of any size, so it would let them hold server memory; serve "
        "reflection only without auth (--reflection=auto or off; clients can use "
        "proto/attnserve/v1/attention.proto instead)");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<StartOptions> StartOptionsFromFlags() {
  StartOptions start;
  start.log_level = absl::GetFlag(FLAGS_log_level);
  // The five documented names only (spdlog also takes "off", which would hide
  // the "listening" line that scripts read, and "critical").
  const std::string& level = start.log_level;
  if (level != "trace" && level != "debug" && level != "info" && level != "warn" && level != "error") {
    return Invalid(absl::StrCat("--log_level=", level, " must be trace, debug, info, warn or error"));
  }
  start.retain_freed_memory = absl::GetFlag(FLAGS_retain_freed_memory);
  absl::StatusOr<KvGeometry> geometry = GeometryFromFlags();
  if (!geometry.ok()) return geometry.status();
  start.geometry = *geometry;
  if (absl::Status s = CoreFlags(&start.core); !s.ok()) return s;
  if (absl::Status s = AddressFlags(&start.server); !s.ok()) return s;
  if (absl::Status s = BackendFlags(start.geometry, start.core, &start); !s.ok()) return s;
  start.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  if (absl::Status s = ServerFlags(start.core, &start); !s.ok()) return s;
  start.drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  return start;
}

}  // namespace attnserve
