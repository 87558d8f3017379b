// gRPC channel and server arguments for moving large tensors, shared by the
// server, attnecho, the C++ client and (by the same names and values) the
// Python client. Header only, with no gRPC include: each side applies the
// (name, value) pairs to its own builder (docs/transport.md, "TCP tuning").
//
// Why each one (gRPC 1.51, chttp2 over TCP; defaults in brackets):
//  - grpc.http2.max_frame_size [16 KiB]: the largest DATA frame this side
//    accepts. A 128 MiB message in 16 KiB frames is 8192 frames, each
//    parsed, and each a separate slice to write; 4 MiB frames make it 32.
//  - grpc.http2.lookahead_bytes [64 KiB] and grpc.http2.bdp_probe [on]:
//    the stream's receive window. With BDP probing the window grows from
//    64 KiB only as pings measure the link, so a large message stalls on
//    WINDOW_UPDATEs for its first tens of MiB; a fixed 64 MiB window lets a
//    sender keep writing. The window is a bound on buffered bytes per stream
//    that the server's max_message_bytes already exceeds.
//  - grpc.http2.write_buffer_size [64 KiB]: how much a stream's writes may
//    buffer ahead of the socket.
//  - Not set: grpc.experimental.tcp_*read_chunk_size. With TLS, gRPC 1.51
//    leaks a read buffer per connection when it is set (LeakSanitizer in
//    tests/ops/security_test.sh), and alone it did not help on the H200
//    (bench/results/2026-11-30-session2-h200x2.md).
// The values never change what is accepted (message size limits stay as
// configured); they trade buffered memory per connection for throughput.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

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
      {"grpc.http2.bdp_probe", 0},
      {"grpc.http2.lookahead_bytes", 64 << 20},
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
    const long value = eq == std::string::npos ? 0 : std::strtol(item.c_str() + eq + 1, &rest, 0);
    if (eq == std::string::npos || eq == 0 || rest == nullptr || *rest != '\0') {
      *error += "'" + item + "' is not name=integer; ";
      continue;
    }
    parsed.emplace_back(item.substr(0, eq), static_cast<int>(value));
  }
  names->reserve(parsed.size());  // the TransportArgs point into *names
  for (auto& [name, value] : parsed) names->push_back(name);
  for (size_t i = 0; i < parsed.size(); ++i) out.push_back({(*names)[i].c_str(), parsed[i].second});
  return out;
}

}  // namespace attnserve
