// Integer arguments of the benchmark tools: the whole text is one decimal
// number within [lo, hi], or the argument is refused (no wrap, no partial
// parse: "--kv_heads=4294967297" is not 1).
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstdlib>

namespace attnserve {

inline bool BenchIntArg(const char* name, const char* text, long lo, long hi, int* out) {
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != 0 || errno == ERANGE || v < lo || v > hi) {
    std::fprintf(stderr, "%s: '%s' is not an integer in [%ld, %ld]\n", name, text, lo, hi);
    return false;
  }
  *out = static_cast<int>(v);
  return true;
}

}  // namespace attnserve
