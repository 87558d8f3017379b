// attnctl: command-line client for attnserve.
//
//   attnctl info
//   attnctl alloc 4
//   attnctl free 0 1 2 3
//   attnctl write --layer=0 SLOT...      (random K/V rows; prints a checksum)
//   attnctl read --layer=0 SLOT...       (--dequantize: an FP8 server's rows as values)
//   attnctl prefill --batch=4 --q_len=64 --kv_len=512   (verified; prints errors)
//   attnctl prefill --window_left=128 --soft_cap=50 --sinks=random
//   attnctl merge --states=3 --n=16                     (verified)
//   attnctl regions                      (the caller's shared-memory regions)
//   attnctl unregister NAME...           (e.g. regions a dead client left)
//   attnctl holdings                     (what the caller's tenant holds, per lease)
//   attnctl release-all                  (releases all of it: pages, plans, regions, leases)
//   attnctl scales                       (an FP8 server's KV scales, every layer)
//   attnctl set-scales --layer=0 --k_scale=0.02 --v_scale=0.01   (or one value per KV head: 0.02,0.03)
//   attnctl health [SERVICE]             (exit 0 only when SERVING)
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli_flags.h"
#include "client/client.h"
#include "client/workload.h"
#include "google/protobuf/text_format.h"
#include "common/dtype.h"
#include "common/usage.h"

ABSL_FLAG(int32_t, layer, 0, "layer for write, read and prefill");
ABSL_FLAG(int32_t, batch, 4, "prefill: sequences");
ABSL_FLAG(int32_t, q_len, 64, "prefill: most query rows per sequence (drawn in [0, q_len])");
ABSL_FLAG(int32_t, kv_len, 256, "prefill: most KV tokens per sequence (drawn in [0, kv_len])");
ABSL_FLAG(bool, causal, true, "prefill: causal mask");
ABSL_FLAG(bool, lse_base_e, false, "prefill/merge: natural-log LSE");
ABSL_FLAG(uint64_t, seed, 1, "random seed");
ABSL_FLAG(int32_t, states, 3, "merge: number of states");
ABSL_FLAG(int64_t, n, 16, "merge: tokens per state");
ABSL_FLAG(bool, dequantize, false,
          "read: an FP8 server's rows as q_dtype values (stored value x scale) instead of the "
          "stored FP8 bytes");
ABSL_FLAG(std::string, k_scale, "",
          "set-scales: K's scale of --layer, one value or num_kv_heads comma-separated values");
ABSL_FLAG(std::string, v_scale, "", "set-scales: V's scale of --layer, as --k_scale");

namespace attnserve {
namespace {

// A message as text, one "name: value" line per field in the proto's order,
// zeros included (DebugString leaves out a field at its default: free_pages
// vanished exactly when the cache was full).
std::string EveryField(const google::protobuf::Message& m) {
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  const google::protobuf::Reflection* r = m.GetReflection();
  std::string out;
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    const int n = f->is_repeated() ? r->FieldSize(m, f) : 1;
    for (int k = 0; k < n; ++k) {
      std::string value;
      google::protobuf::TextFormat::PrintFieldValueToString(m, f, f->is_repeated() ? k : -1, &value);
      absl::StrAppend(&out, f->name(), ": ", value, "\n");
    }
  }
  return out;
}

int Fail(const absl::Status& status) {
  std::cerr << "error: " << status.ToString() << "\n";
  return 1;
}


// The integer arguments args[from..], each in [0, hi]: an error naming
// the argument (`what`), its position and the bound otherwise.
absl::StatusOr<std::vector<int64_t>> ParseInts(const std::vector<char*>& args, size_t from, const char* what,
                                               int64_t hi) {
  std::vector<int64_t> out;
  for (size_t i = from; i < args.size(); ++i) {
    int64_t v;
    if (!absl::SimpleAtoi(args[i], &v)) {
      return absl::InvalidArgumentError(absl::StrCat(what, " ", args[i], " (argument ", i - from + 1,
                                                     ") is not an integer in [0, ", hi, "]"));
    }
    if (v < 0 || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", args[i], " (argument ", i - from + 1, ") out of range [0, ", hi, "]"));
    }
    out.push_back(v);
  }
  return out;
}

// set-scales' --layer, --k_scale and --v_scale: each scale list one or
// more numbers separated by single commas.
absl::StatusOr<LayerKvScales> ScalesFromFlags() {
  LayerKvScales l;
  l.layer = absl::GetFlag(FLAGS_layer);
  for (auto [flag, name, out] : {std::tuple{absl::GetFlag(FLAGS_k_scale), "--k_scale", &l.k_scale},
                                 std::tuple{absl::GetFlag(FLAGS_v_scale), "--v_scale", &l.v_scale}}) {
    if (flag.empty()) {
      return absl::InvalidArgumentError(
          "usage: attnctl set-scales --layer=L --k_scale=X[,X...] --v_scale=Y[,Y...]");
    }
    for (absl::string_view part : absl::StrSplit(flag, ',')) {
      double x = 0;
      if (!absl::SimpleAtod(part, &x)) {
        return absl::InvalidArgumentError(absl::StrCat(name, "=", flag, ": not a list of numbers (\"", part, "\")"));
      }
      // The wire carries float32: a value that would become an infinity or
      // 0 there is named here as given.
      const float f = static_cast<float>(x);
      if (std::isfinite(x) && (!std::isfinite(f) || (x != 0 && f == 0))) {
        return absl::InvalidArgumentError(absl::StrCat(
            name, "=", flag, ": ", part, " does not fit a float32 (0, or a magnitude in [1.4e-45, 3.4e38])"));
      }
      out->push_back(f);
    }
  }
  return l;
}

// The commands' arguments, before attnctl connects: usage (exit 2) for a
// command that needs arguments and has none, and an error naming the
// argument and its bound (exit 2) for a bad one.
absl::Status CheckArgs(const std::string& cmd, const std::vector<char*>& args) {
  const char* usage = nullptr;
  if (cmd == "free") usage = "attnctl free PAGE...";
  if (cmd == "write") usage = "attnctl write [--layer=L] SLOT...";
  if (cmd == "read") usage = "attnctl read [--layer=L] [--dequantize] SLOT...";
  if (cmd == "unregister") usage = "attnctl unregister NAME...";
  if (cmd == "set-scales") return ScalesFromFlags().status();
  if (cmd == "alloc") {
    // No default count: pages outlive attnctl (they hold no lease), so it
    // takes only what it is told to.
    if (args.size() != 3) {
      return absl::InvalidArgumentError(
          "usage: attnctl alloc COUNT (the pages stay allocated until `attnctl free` or `attnctl release-all`)");
    }
    return ParseInts(args, 2, "COUNT", std::numeric_limits<int32_t>::max()).status();
  }
  if (usage == nullptr) return absl::OkStatus();
  if (args.size() < 3) return absl::InvalidArgumentError(absl::StrCat("usage: ", usage));
  if (cmd == "free") return ParseInts(args, 2, "PAGE", std::numeric_limits<int32_t>::max()).status();
  if (cmd == "write" || cmd == "read") {
    return ParseInts(args, 2, "SLOT", std::numeric_limits<int64_t>::max()).status();
  }
  return absl::OkStatus();
}

// The numeric flags of prefill and merge, before anything is allocated: an
// error naming the flag and its bound (exit 2), as attnbench's. Products
// are bounded so that what attnctl builds fits the server's default message
// (65,536 rows of 32 heads of 128 in 512 MiB).
absl::Status CheckCountFlags(const std::string& cmd) {
  struct Range {
    const char* name;
    int64_t value, lo, hi;
  };
  constexpr int64_t kMaxRows = 65536;
  constexpr int64_t kMaxKv = int64_t{1} << 24;
  std::vector<Range> ranges;
  if (cmd == "prefill") {
    const int64_t batch = absl::GetFlag(FLAGS_batch), q = absl::GetFlag(FLAGS_q_len),
                  kv = absl::GetFlag(FLAGS_kv_len);
    ranges = {{"batch", batch, 1, kMaxRows},
              {"q_len", q, 0, kMaxRows},
              {"kv_len", kv, 0, kMaxKv},
              {"batch x --q_len (query rows at most)", batch * q, 0, kMaxRows},
              {"batch x --kv_len (KV tokens at most)", batch * kv, 0, kMaxKv}};
  } else if (cmd == "merge") {
    const int64_t states = absl::GetFlag(FLAGS_states), n = absl::GetFlag(FLAGS_n);
    ranges = {{"states", states, 1, 256},
              {"n", n, 1, kMaxRows},
              {"states x --n (rows in all)", states * n, 0, kMaxRows}};
  }
  // In order: a product is checked once its factors are in range.
  for (const Range& r : ranges) {
    if (r.value < r.lo || r.value > r.hi) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", r.name, " = ", r.value, " out of range [", r.lo, ", ", r.hi, "]"));
    }
  }
  return absl::OkStatus();
}

template <typename T>
uint64_t Checksum(const std::vector<T>& a) {
  uint64_t h = 1469598103934665603ull;
  for (T x : a) h = (h ^ x) * 1099511628211ull;
  return h;
}

int Prefill(Client& client) {
  const KvGeometry g = GeometryOf(client.info());
  std::mt19937_64 gen(absl::GetFlag(FLAGS_seed));
  WorkloadSpec spec;
  spec.batch = absl::GetFlag(FLAGS_batch);
  spec.max_q_len = absl::GetFlag(FLAGS_q_len);
  spec.max_kv_len = absl::GetFlag(FLAGS_kv_len);
  spec.causal = absl::GetFlag(FLAGS_causal);
  spec.lse_base_e = absl::GetFlag(FLAGS_lse_base_e);
  spec.layer = absl::GetFlag(FLAGS_layer);
  auto flag_options = AttentionOptionsFromFlags(g.num_qo_heads, gen);
  if (!flag_options.ok()) return Fail(flag_options.status());
  const AttentionOptions options = *std::move(flag_options);
  const int64_t need = PagesNeeded(g, spec);
  auto pages = client.AllocatePages(static_cast<int32_t>(std::max<int64_t>(need, 1)));
  if (!pages.ok()) return Fail(pages.status());
  // Fill every allocated page with random K/V and keep a copy for the reference.
  KvMirror mirror(g);
  // An FP8 server quantizes the rows with its scales: the mirror does too.
  if (absl::Status s = MirrorServerScales(client, &mirror); !s.ok()) return Fail(s);
  std::vector<int64_t> slots = SlotsOfPages(g, *pages);
  // An MLA server takes the latent rows in k alone.
  const int64_t rows = static_cast<int64_t>(slots.size());
  auto k = RandomHalves(gen, g.dtype, rows * g.RowElems());
  auto v = RandomHalves(gen, g.dtype, g.HasVPool() ? rows * g.RowElems() : 0);
  absl::Status status = client.WriteKV(spec.layer, slots, k, v);
  int rc = 0;
  if (status.ok()) {
    mirror.Write(spec.layer, slots, k, v);
    PrefillInputs in = RandomPrefill(gen, g, spec, *pages);
    in.options = options;
    PrefillArgs args = ArgsOf(in);
    auto out = client.Prefill(args);
    if (!out.ok()) {
      rc = Fail(out.status());
    } else {
      std::vector<double> o_ref, lse_ref, lse_bound;
      ReferencePrefill(mirror, in, &o_ref, &lse_ref, client.info().fp8_query_min_rows(), &lse_bound);
      Comparison c = Compare(g.dtype, o_ref, lse_ref, out->o, out->lse, lse_bound);
      std::cout << "prefill: batch=" << spec.batch << " total_q=" << in.total_q()
                << " kv_pages=" << in.kv_indices.size() << " backend=" << client.info().backend()
                << "\n"
                << c.ToString() << (c.Ok(g.dtype) ? "  OK" : "  FAILED") << "\n";
      rc = c.Ok(g.dtype) ? 0 : 3;
    }
  } else {
    rc = Fail(status);
  }
  absl::Status freed = client.FreePages(*pages);
  if (!freed.ok()) return Fail(freed);
  return rc;
}

int Merge(Client& client) {
  const KvGeometry g = GeometryOf(client.info());
  std::mt19937_64 gen(absl::GetFlag(FLAGS_seed));
  const int64_t n = absl::GetFlag(FLAGS_n);
  const int32_t h = g.num_qo_heads, d = g.VDim();  // MLA: kv_lora_rank wide
  const int num_states = absl::GetFlag(FLAGS_states);
  std::vector<State> states(num_states);
  std::normal_distribution<float> lse_dist(0.f, 4.f);
  for (int s = 0; s < num_states; ++s) {
    states[s].v = RandomHalves(gen, g.dtype, n * h * d);
    states[s].lse.resize(n * h);
    for (auto& l : states[s].lse) l = lse_dist(gen);
  }
  // Some rows see nothing in the first state.
  for (int64_t r = 0; r < n * h; r += 3) states[0].lse[r] = -INFINITY;
  auto out = client.MergeStates(states, n, h, d, absl::GetFlag(FLAGS_lse_base_e));
  if (!out.ok()) return Fail(out.status());
  // float64 reference.
  const double base_ln = absl::GetFlag(FLAGS_lse_base_e) ? 1.0 : std::log(2.0);
  // A row that sees nothing in any state (all LSEs -inf) merges to (0,
  // -inf): it must come back exactly so. A NaN anywhere fails.
  double diff = 0, norm = 0, lse_err = 0;
  bool bad = false;
  for (int64_t r = 0; r < n * h; ++r) {
    double m = -INFINITY;
    for (auto& s : states) m = std::max<double>(m, s.lse[r]);
    double total = 0;
    std::vector<double> acc(d, 0.0);
    for (auto& s : states) {
      if (s.lse[r] == -INFINITY) continue;
      const double w = std::exp((s.lse[r] - m) * base_ln);
      total += w;
      for (int c = 0; c < d; ++c) acc[c] += w * HalfToFloat(g.dtype, s.v[r * d + c]);
    }
    for (int c = 0; c < d; ++c) {
      const double ref = total > 0 ? acc[c] / total : 0.0;
      const double got = HalfToFloat(g.dtype, out->v[r * d + c]);
      bad |= std::isnan(got);
      diff += (got - ref) * (got - ref);
      norm += ref * ref;
    }
    const double lse = out->lse[r];
    if (total > 0) {
      const double e = std::abs(lse - (m + std::log(total) / base_ln));
      bad |= !(e == e);
      lse_err = std::max(lse_err, e);
    } else {
      bad |= lse != -INFINITY;
    }
  }
  const double rel = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  const bool ok = !bad && rel < 1e-2 && lse_err < 1e-3;
  std::cout << "merge: states=" << num_states << " n=" << n << " v_rel_error=" << rel
            << " lse_max_abs_error=" << lse_err << (ok ? "  OK" : "  FAILED") << "\n";
  return ok ? 0 : 3;
}

// Whether `arg` is a flag written without "=VALUE" that takes the next
// argument as its value (not a boolean flag: --dequantize, --nocausal).
bool TakesNextArg(absl::string_view arg) {
  if (arg.size() < 2 || arg[0] != '-' || absl::StrContains(arg, '=')) return false;
  arg.remove_prefix(arg[1] == '-' ? 2 : 1);
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(arg);
  if (flag == nullptr && absl::StartsWith(arg, "no")) {
    flag = absl::FindCommandLineFlag(arg.substr(2));
    if (flag != nullptr && flag->IsOfType<bool>()) return false;
  }
  return flag != nullptr && !flag->IsOfType<bool>();
}

int Main(std::vector<char*> args) {
  if (args.size() < 2) {
    std::cerr << absl::ProgramUsageMessage() << "\n(attnctl --help also lists the flags)\n";
    return 2;
  }
  const std::string cmd = args[1];
  if (absl::Status s = CheckCountFlags(cmd); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  if (absl::Status s = CheckArgs(cmd, args); !s.ok()) {
    std::cerr << (absl::StartsWith(s.message(), "usage: ") ? "" : "error: ") << s.message() << "\n";
    return 2;
  }
  if (absl::Status s = CheckClientFlags(); !s.ok()) {
    std::cerr << "error: " << s.message() << "\n";
    return 2;
  }
  ClientOptions options = ClientOptionsFromFlags();
  options.fetch_info = cmd != "health";  // probes carry no credentials
  auto client = Client::Connect(options);
  if (!client.ok()) {
    if (cmd == "health") std::cout << "NOT_SERVING (" << client.status().ToString() << ")\n";
    return Fail(client.status());
  }
  Client& c = **client;
  if (cmd == "health") {
    absl::Status s = c.Health(args.size() > 2 ? args[2] : "");
    std::cout << (s.ok() ? "SERVING" : s.ToString()) << "\n";
    return s.ok() ? 0 : 1;
  }
  if (cmd == "info") {
    std::cout << EveryField(c.info());
    return 0;
  }
  if (cmd == "alloc") {
    const int32_t count = static_cast<int32_t>((*ParseInts(args, 2, "COUNT", INT32_MAX))[0]);  // checked: CheckArgs
    auto pages = c.AllocatePages(count);
    if (!pages.ok()) return Fail(pages.status());
    std::cout << absl::StrJoin(*pages, " ") << "\n";
    return 0;
  }
  if (cmd == "free") {
    auto ids = ParseInts(args, 2, "PAGE", std::numeric_limits<int32_t>::max());  // checked: CheckArgs
    if (!ids.ok()) return Fail(ids.status());
    std::vector<int32_t> pages(ids->begin(), ids->end());
    absl::Status s = c.FreePages(pages);
    if (!s.ok()) return Fail(s);
    std::cout << "freed " << pages.size() << " pages\n";
    return 0;
  }
  if (cmd == "write" || cmd == "read") {
    auto slots = ParseInts(args, 2, "SLOT", std::numeric_limits<int64_t>::max());  // checked: CheckArgs
    if (!slots.ok()) return Fail(slots.status());
    const KvGeometry g = GeometryOf(c.info());
    if (cmd == "write") {
      std::mt19937_64 gen(absl::GetFlag(FLAGS_seed));
      const int64_t rows = static_cast<int64_t>(slots->size());
      auto k = RandomHalves(gen, g.dtype, rows * g.RowElems());
      auto v = RandomHalves(gen, g.dtype, g.HasVPool() ? rows * g.RowElems() : 0);
      absl::Status s = c.WriteKV(absl::GetFlag(FLAGS_layer), *slots, k, v);
      if (!s.ok()) return Fail(s);
      std::cout << "wrote " << slots->size() << " rows, k checksum " << Checksum(k);
      if (g.HasVPool()) std::cout << ", v checksum " << Checksum(v);
      std::cout << "\n";
    } else {
      auto kv = c.ReadKV(absl::GetFlag(FLAGS_layer), *slots, absl::GetFlag(FLAGS_dequantize));
      if (!kv.ok()) return Fail(kv.status());
      if (!kv->k_fp8.empty() || !kv->v_fp8.empty()) {
        std::cout << "read " << slots->size() << " rows as stored ("
                  << v1::DType_Name(c.info().kv_dtype()) << "), k checksum "
                  << Checksum(kv->k_fp8) << ", v checksum " << Checksum(kv->v_fp8) << "\n";
      } else {
        std::cout << "read " << slots->size() << " rows, k checksum " << Checksum(kv->k);
        if (g.HasVPool()) std::cout << ", v checksum " << Checksum(kv->v);
        std::cout << "\n";
      }
    }
    return 0;
  }
  if (cmd == "scales") {
    auto scales = c.GetKvScales();
    if (!scales.ok()) return Fail(scales.status());
    if (scales->empty()) {
      std::cout << "no KV scales: the server's kv_dtype is " << v1::DType_Name(c.info().kv_dtype())
                << " (scales apply to FP8 caches)\n";
    }
    for (const LayerKvScales& l : *scales) {
      std::cout << "layer " << l.layer << " k_scale " << absl::StrJoin(l.k_scale, ",")
                << " v_scale " << absl::StrJoin(l.v_scale, ",") << "\n";
    }
    return 0;
  }
  if (cmd == "set-scales") {
    auto l = ScalesFromFlags();  // checked: CheckArgs
    if (!l.ok()) return Fail(l.status());
    absl::Status s = c.SetKvScales({*l});
    if (!s.ok()) return Fail(s);
    std::cout << "layer " << l->layer << " scales set\n";
    return 0;
  }
  if (cmd == "regions") {
    auto regions = c.ListRegions();
    if (!regions.ok()) return Fail(regions.status());
    for (const v1::RegionInfo& r : *regions) {
      std::cout << r.name() << " kind=" << r.kind() << " bytes=" << r.byte_size();
      if (r.kind() == "system") {
        // key: the memfd's name; key_exists: its client still holds it.
        std::cout << " key=" << r.key() << " offset=" << r.offset()
                  << " holder=" << (r.key_exists() ? "open" : "closed")
                  << " registered=" << (r.registered() ? "yes" : "no");
      } else {
        std::cout << " device=" << r.device_id();
      }
      std::cout << " in_use=" << r.in_use() << "\n";
    }
    std::cout << regions->size() << " regions\n";
    return 0;
  }
  if (cmd == "unregister") {
    for (size_t i = 2; i < args.size(); ++i) {
      absl::Status s = c.UnregisterRegion(args[i]);
      if (!s.ok()) return Fail(s);
      std::cout << "unregistered " << args[i] << "\n";
    }
    return 0;
  }
  if (cmd == "holdings") {
    auto held = c.ListHoldings();
    if (!held.ok()) return Fail(held.status());
    auto print = [](const v1::Holdings& h) {
      std::cout << " pages=[" << absl::StrJoin(h.page_ids(), " ") << "] plans="
                << h.plan_ids_size() << " regions=[" << absl::StrJoin(h.region_names(), " ")
                << "] channels=" << h.channel_ids_size() << "\n";
    };
    for (const v1::LeaseInfo& l : held->leases()) {
      std::cout << "lease " << absl::StrCat(absl::Hex(l.lease_id())) << " ttl_ms=" << l.ttl_ms()
                << " remaining_ms=" << l.remaining_ms();
      print(l.holdings());
    }
    std::cout << "unleased";
    print(held->unleased());
    return 0;
  }
  if (cmd == "release-all") {
    auto released = c.ReleaseHoldings();
    if (!released.ok()) return Fail(released.status());
    std::cout << "released " << released->page_ids_size() << " pages, "
              << released->plan_ids_size() << " plans, " << released->region_names_size()
              << " regions, " << released->channel_ids_size() << " channels\n";
    return 0;
  }
  if (cmd == "prefill") return Prefill(c);
  if (cmd == "merge") return Merge(c);
  std::cerr << "unknown command: " << cmd << "\n" << absl::ProgramUsageMessage() << "\n";
  return 2;
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  // A negative number would reach the flag parser as an unknown flag ("-1"
  // as flag "1"); attnctl's arguments (pages, slots, counts) are >= 0. (Not
  // the value of a flag given as "--flag VALUE".)
  for (int i = 1; i < argc && std::string(argv[i]) != "--"; ++i) {
    const bool flag_value = i > 1 && attnserve::TakesNextArg(argv[i - 1]);
    if (!flag_value && argv[i][0] == '-' && argv[i][1] >= '0' && argv[i][1] <= '9') {
      std::cerr << "error: argument " << argv[i] << " is negative: pages, slots and counts are >= 0\n";
      return 2;
    }
  }
  std::vector<char*> args = attnserve::ParseCommandLine(
      argc, argv,
      {"attnctl",
       "attnctl [flags] COMMAND: command-line client for attnserve.\n"
       "  info                 the server's geometry, backend, free pages and incarnation\n"
       "  alloc COUNT          allocate pages; prints their ids\n"
       "  free PAGE...         free pages\n"
       "  write SLOT...        random K/V rows into slots of --layer; prints checksums\n"
       "  read SLOT...         read K/V rows of --layer; prints checksums (an FP8 server's\n"
       "                       stored bytes, or with --dequantize their values)\n"
       "  regions              the caller's shared-memory regions (docs/transport.md)\n"
       "  unregister NAME...   unregister regions (e.g. ones a dead client left)\n"
       "  holdings             what the caller's tenant holds: pages, plans, regions and\n"
       "                       channels, per lease and unleased (docs/security.md, Leases)\n"
       "  release-all          release everything the caller's tenant holds, leases included\n"
       "  prefill              a random ragged batch, verified against a float64 reference\n"
       "  merge                random states merged by the server, verified\n"
       "  scales               an FP8 server's KV scales of every layer\n"
       "  set-scales           set --layer's --k_scale and --v_scale on an FP8 server\n"
       "  health [SERVICE]     exit 0 only when SERVING",
       {{"client/attnctl.cc", "Flags"}, {"client/cli_flags.cc", "Connection flags"},
        {"client/variant_flags.cc", "Attention option flags"}}});
  attnserve::HideGrpcLogs();
  return attnserve::Main(args);
}
