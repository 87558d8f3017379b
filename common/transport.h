// gRPC channel and server arguments for moving large tensors, shared by the
// server, attnecho, the C++ client and (by the same names and values) the
// Python client. Header only, with no gRPC include: each side applies the
// (name, value) pairs to its own builder (docs/transport.md, "TCP tuning").
//
// Why each one (gRPC 1.51, chttp2 over TCP; defaults in brackets), from the
// single-setting runs on the H200 host (bench/results/
// 2026-11-30-session2-h200x2.md: attnecho decode64 p50 / 128 MiB p50, gRPC
// defaults 1.116 ms / 1052 ms):
//  - grpc.http2.max_frame_size [16 KiB] -> 4 MiB: the largest DATA frame this
//    side accepts. A 128 MiB message in 16 KiB frames is 8192 frames, each
//    parsed and each a separate slice to write; 4 MiB frames make it 32.
//    Alone: 1.096 ms / 946 ms.
//  - grpc.http2.write_buffer_size [64 KiB] -> 8 MiB: how much a stream's
//    writes may buffer ahead of the socket. Alone: 1.079 ms / 946 ms.
//  - Left at gRPC's defaults: BDP probing and the stream window
//    (grpc.http2.bdp_probe, grpc.http2.lookahead_bytes). A fixed 64 MiB
//    window without probing helped 128 MiB (958 ms) but cost decode64
//    0.2 ms (1.319 ms); with probing on, the window grows to what the link
//    needs. The previous tuned set had them; bench/run_transport_gpu.sh
//    still measures it through --grpc_args.
//  - Not set: grpc.experimental.tcp_*read_chunk_size. With TLS, gRPC 1.51
//    leaks a read buffer per connection when it is set (LeakSanitizer in
//    tests/ops/security_test.sh), and alone it did not help on the H200.
// The values never change what is accepted (message size limits stay as
// configured); they trade buffered memory per connection for throughput.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>  // mallopt
#endif

namespace attnserve {

struct TransportArg {
  const char* name;
  int value;
};

// The tuned set (tuned = true) or none (gRPC's defaults).
inline std::vector<TransportArg> TransportArgs(bool tuned) {
  if (!tuned) return {};
  return {
      {"grpc.http2.max_frame_size", 4 << 20},
      {"grpc.http2.write_buffer_size", 8 << 20},
  };
}

// Parses extra "name=int,name=int" overrides (for experiments: attnecho,
// attnbench and attnserve take them as --grpc_args). Malformed entries are
// reported in *error and skipped.
inline std::vector<TransportArg> ParseTransportArgs(const std::string& spec,
                                                    std::vector<std::string>* names,
                                                    std::string* error) {
  std::vector<TransportArg> out;
  size_t start = 0;
  names->clear();
  std::vector<std::pair<std::string, int>> parsed;
  while (start < spec.size()) {
    size_t end = spec.find(',', start);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    char* rest = nullptr;
    errno = 0;
    const long value = eq == std::string::npos ? 0 : std::strtol(item.c_str() + eq + 1, &rest, 0);
    if (eq == std::string::npos || eq == 0 || rest == nullptr || *rest != '\0' ||
        rest == item.c_str() + eq + 1) {
      *error += "'" + item + "' is not name=integer; ";
      continue;
    }
    // gRPC's integer arguments are ints: a value past them is refused, not
    // wrapped into another limit (2^32 + 1 streams would become 1).
    if (errno == ERANGE || value < std::numeric_limits<int>::min() ||
        value > std::numeric_limits<int>::max()) {
      *error += "'" + item + "' is out of range [" + std::to_string(std::numeric_limits<int>::min()) +
                ", " + std::to_string(std::numeric_limits<int>::max()) + "]; ";
      continue;
    }
    parsed.emplace_back(item.substr(0, eq), static_cast<int>(value));
  }
  names->reserve(parsed.size());  // the TransportArgs point into *names
  for (auto& [name, value] : parsed) names->push_back(name);
  for (size_t i = 0; i < parsed.size(); ++i) out.push_back({(*names)[i].c_str(), parsed[i].second});
  return out;
}

// The clients' gRPC service config (GRPC_ARG_SERVICE_CONFIG; the Python
// client's RETRY_SERVICE_CONFIG is the same JSON): a call that fails with
// UNAVAILABLE (no connection, or a draining server) is tried again up to 3
// more times, after waits of about 0.05, 0.1 and 0.2 s (gRPC's backoff from
// initialBackoff, doubling, each wait jittered by +-20%). Only the idempotent methods: running one of
// them twice leaves what once does (Prefill's fused appends write the same
// rows again). AllocatePages, FreePages, CreatePlan, ReleasePlan,
// RegisterRegion, UnregisterRegion, OpenChannel and CloseChannel are never
// retried: a repeat of one the server had already run would leave the
// client's books wrong (pages allocated twice, a "not found" for a free that
// happened). The clients raise gRPC's per-call retry buffer (256 KiB by
// default, past which nothing is retried) to their largest message.
inline constexpr char kClientServiceConfig[] = R"json({
  "methodConfig": [{
    "name": [
      {"service": "attnserve.v1.AttentionService", "method": "GetServerInfo"},
      {"service": "attnserve.v1.AttentionService", "method": "Prefill"},
      {"service": "attnserve.v1.AttentionService", "method": "WriteKV"},
      {"service": "attnserve.v1.AttentionService", "method": "ReadKV"},
      {"service": "attnserve.v1.AttentionService", "method": "MergeStates"},
      {"service": "attnserve.v1.AttentionService", "method": "ListRegions"}
    ],
    "retryPolicy": {
      "maxAttempts": 4,
      "initialBackoff": "0.05s",
      "maxBackoff": "1s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["UNAVAILABLE"]
    }
  }]
})json";

// glibc malloc, process-wide: keep freed memory for the next message instead
// of returning it to the kernel. gRPC receives a message into slices of up
// to 4 MiB from malloc; by default glibc trims its heap once more than about
// twice the largest freed block is free at the top, so every large message
// is received into memory the kernel must fault in and zero again (a 128 MiB
// message: 32,768 page faults; a 128 MiB prefill's round trip took 13-40 ms
// longer on the H200 host, bench/results/2026-12-01-session6-h200x2.md). This
// serves blocks up to 32 MiB (glibc's limit) from the heap and trims only
// past 1 GiB free: the process keeps up to that much freed memory mapped
// per malloc arena. attnserve and attnecho call it unless
// --retain_freed_memory=false, attnbench likewise; a C++ client process that
// sends or receives large inline tensors may call it once at start
// (attnserve.retain_freed_memory() in Python). False where it has no effect
// (not glibc, or glibc refused a value).
inline bool RetainFreedMemory() {
#if defined(__GLIBC__)
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1;
#else
  return false;
#endif
}

}  // namespace attnserve
