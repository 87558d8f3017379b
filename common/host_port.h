// HOST:PORT addresses, as every program takes them (the server's listen
// flags, the clients' targets, attnbench's --metrics, the bench tools).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace attnserve {

struct HostPort {
  std::string host;
  std::string port;
};

// Split at the last colon; HOST without the brackets of an IPv6 literal.
// Nothing without a colon.
inline std::optional<HostPort> SplitHostPort(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  HostPort hp{address.substr(0, colon), address.substr(colon + 1)};
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  }
  return hp;
}

// Whether `s` is a non-empty run of decimal digits.
inline bool AllDigits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// The port as a number in [lo, 65535], or -1 (not digits, or out of range).
inline int PortNumber(std::string_view port, int lo) {
  if (!AllDigits(port) || port.size() > 5) return -1;
  int p = 0;
  for (char c : port) p = p * 10 + (c - '0');
  return p >= lo && p <= 65535 ? p : -1;
}

}  // namespace attnserve
