// The attention options of the command-line clients' Prefills (attnctl,
// attnbench): --window_left, --soft_cap, --sinks (docs/design.md,
// "Variants"); their own group in --help.
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cli_flags.h"

ABSL_FLAG(int32_t, window_left, -1,
          "prefill: sliding window, a row at position p sees keys p - window_left .. p; -1: none");
ABSL_FLAG(float, soft_cap, 0,
          "prefill: logit soft-cap c, logits become c * tanh(x / c); 0: none, otherwise in [1e-30, 1e30]");
ABSL_FLAG(std::string, sinks, "",
          "prefill: attention sinks, one logit per query head: 'random', one number for every "
          "head, or num_qo_heads comma-separated numbers; empty: none");

namespace attnserve {
namespace {

// The numbers of a --sinks list ("a,b,..."), or the error naming the entry.
absl::StatusOr<std::vector<float>> ParseSinks(const std::string& sinks) {
  std::vector<float> out;
  for (absl::string_view part : absl::StrSplit(sinks, ',')) {
    float x = 0;
    if (!absl::SimpleAtof(part, &x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sinks=", sinks, ": '", part, "' is not a number"));
    }
    out.push_back(x);
  }
  return out;
}

}  // namespace

absl::StatusOr<AttentionOptions> AttentionOptionsFromFlags(int32_t num_qo_heads,
                                                           std::mt19937_64& gen) {
  AttentionOptions o;
  if (const int32_t w = absl::GetFlag(FLAGS_window_left); w != -1) o.window_left = w;
  if (const float c = absl::GetFlag(FLAGS_soft_cap); c != 0.f) o.logits_soft_cap = c;
  const std::string sinks = absl::GetFlag(FLAGS_sinks);
  if (sinks.empty()) return o;
  if (sinks == "random") {
    std::normal_distribution<float> dist(0.f, 1.f);
    for (int32_t h = 0; h < num_qo_heads; ++h) o.sinks.push_back(dist(gen));
    return o;
  }
  auto parsed = ParseSinks(sinks);
  if (!parsed.ok()) return parsed.status();
  o.sinks = *std::move(parsed);
  if (o.sinks.size() == 1) o.sinks.assign(num_qo_heads, o.sinks[0]);
  return o;
}

absl::Status CheckAttentionFlags() {
  const std::string sinks = absl::GetFlag(FLAGS_sinks);
  if (sinks.empty() || sinks == "random") return absl::OkStatus();
  return ParseSinks(sinks).status();
}

}  // namespace attnserve
