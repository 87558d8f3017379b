// attnserve_decode_bench: times the decode kernel family (kernels/decode/)
// on the workloads of issue #14 against the prefill kernel on the same
// inputs, and the same-run device copy ceiling.
//
// Shapes: 32 query heads / 4 KV heads / head_dim 128 / bf16, page ids in
// random order, page_size 1 and 16. Timing: CUDA events around each launch
// (the decode launch includes its fused merge; the prefill one is followed by
// its merge launch when split), warm-up, median of repeats, input sets
// rotated when one set fits in L2. Each latency is timed twice: `ms` on an
// idle device (the host's launch latency between the start event and the
// kernel included, as one lone call runs) and `ms_queued` with a 50 us spin
// kernel ahead of the start event, so that the events and the launch wait
// behind it and measure device time alone (as a launch runs inside a stream
// of work). The PyTorch baselines (bench/torch_decode_baselines.py) report
// both the same way. K/V bytes = 2 * batch * kv_len * 4 heads *
// 128 * 2 bytes: each byte read once is the floor.
//
// FP8 workloads (names ending _e4m3 / _e5m2; issue #32) run the same shapes
// on FP8 pools (1 byte an element, per-head scales) with bf16 queries; their
// bytes count one byte an element, and they have no prefill comparison (the
// prefill families read 16-bit pools only).
//
// Usage: attnserve_decode_bench [--quick] [--only=WORKLOAD[,WORKLOAD...]]
//                               [--four_ctas=-1|0|1] [--kv_heads=N] [--trace]
//                               [--trace_dump=PATH]
//   --only: run the workloads of those names alone (e.g. decode_b1, for ncu)
//   --four_ctas: DecodeLaunchOptions::four_ctas of every decode launch (FP8,
//     head_dim 128: the kernel compiled for four CTAs an SM; -1, the
//     default, lets the launch choose; 0 also plans for the three-CTA
//     kernel alone, DecodePlanOptions::wide_ctas_per_sm 0)
//   --kv_heads: KV heads of every workload (default 4; 8 query heads each):
//     the same bytes a KV head, the pool's rows N heads wide
//   --trace: one more launch of each decode workload with per-CTA stamps
//     (DecodeLaunchOptions::trace), printed as a "TRACE ..." line: when the
//     CTAs started, how long each streamed its K/V, and the tail; and a
//     "TRACE_PAIRS ..." line: on SMs holding two CTAs, the faster and the
//     slower one
//   --trace_dump: with --trace, every traced CTA appended to PATH as CSV
// Prints one "RESULT key=value ..." line per measurement, then a table with
// the targets.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/args.h"
#include "bench/check_cuda.h"
#include "bench/gpu_spin.h"
#include "kernels/decode/decode_cuda.h"
#include "kernels/merge/merge_cuda.h"
#include "kernels/plan/kernel_select.h"
#include "kernels/prefill_cuda.h"
#include "kernels/plan/decode_plan.h"

namespace attnserve {
namespace {

// --four_ctas (DecodeLaunchOptions::four_ctas).
int g_four_ctas = -1;

// --kv_heads: KV heads of every workload (8 query heads each).
int g_kv_heads = 4;

// --trace: after the timed runs, one more launch of each decode workload
// with DecodeLaunchOptions::trace, summarized by PrintTrace.
bool g_trace = false;
// --trace_dump=PATH: with --trace, every traced CTA appended to PATH as CSV
// (workload, page_size, cta, sm, then ns from the launch's first start:
// start, streamed, end).
std::string g_trace_dump;

// One traced launch (kDecodeTraceWords words a CTA): when the CTAs started,
// how long each streamed its K/V, and when the number still streaming fell
// to 95 / 75 / 50 / 25 / 0% of them (the tail), in us from the first start.
void PrintTrace(const std::string& name, int page_size, const std::vector<unsigned long long>& w) {
  const size_t n = w.size() / kDecodeTraceWords;
  if (n == 0) return;
  auto at = [&](size_t i, int k) { return w[i * kDecodeTraceWords + k]; };
  unsigned long long t0 = at(0, kDecodeTraceStart), last_start = t0, end = 0;
  for (size_t i = 0; i < n; ++i) {
    t0 = std::min(t0, at(i, kDecodeTraceStart));
    last_start = std::max(last_start, at(i, kDecodeTraceStart));
    end = std::max(end, at(i, kDecodeTraceEnd));
  }
  std::vector<double> streamed(n), took(n);
  // The CTAs each SM ran.
  std::vector<std::vector<size_t>> on_sm(1024);
  for (size_t i = 0; i < n; ++i) {
    streamed[i] = (at(i, kDecodeTraceStreamed) - t0) * 1e-3;
    took[i] = (at(i, kDecodeTraceStreamed) - at(i, kDecodeTraceStart)) * 1e-3;
    on_sm[at(i, kDecodeTraceSm) % 1024].push_back(i);
  }
  // Streaming time of CTAs alone on their SM against those sharing it.
  double alone = 0, shared = 0;
  int n_alone = 0, n_shared = 0;
  for (size_t i = 0; i < n; ++i) {
    if (on_sm[at(i, kDecodeTraceSm) % 1024].size() == 1) {
      alone += took[i];
      ++n_alone;
    } else {
      shared += took[i];
      ++n_shared;
    }
  }
  // SMs holding two CTAs: the faster and the slower one's streaming time,
  // and how often the CTA that started first is the faster (us).
  double pair_fast = 0, pair_slow = 0;
  int pairs = 0, first_faster = 0;
  for (const auto& v : on_sm) {
    if (v.size() != 2) continue;
    const size_t a = at(v[0], kDecodeTraceStart) <= at(v[1], kDecodeTraceStart) ? v[0] : v[1];
    const size_t b = a == v[0] ? v[1] : v[0];
    pair_fast += std::min(took[a], took[b]);
    pair_slow += std::max(took[a], took[b]);
    first_faster += took[a] <= took[b];
    ++pairs;
  }
  std::printf("TRACE_PAIRS workload=%s page_size=%d sm_pairs=%d stream_us_faster=%.2f stream_us_slower=%.2f "
              "first_started_faster=%d\n",
              name.c_str(), page_size, pairs, pairs ? pair_fast / pairs : 0.0, pairs ? pair_slow / pairs : 0.0,
              first_faster);
  if (!g_trace_dump.empty()) {
    if (FILE* f = std::fopen(g_trace_dump.c_str(), "a")) {
      for (size_t i = 0; i < n; ++i) {
        auto rel = [&](int k) { return static_cast<long long>(at(i, k) - t0); };
        std::fprintf(f, "%s,%d,%zu,%llu,%lld,%lld,%lld\n", name.c_str(), page_size, i, at(i, kDecodeTraceSm),
                     rel(kDecodeTraceStart), rel(kDecodeTraceStreamed), rel(kDecodeTraceEnd));
      }
      std::fclose(f);
    }
  }
  std::sort(streamed.begin(), streamed.end());
  std::sort(took.begin(), took.end());
  auto q = [](const std::vector<double>& v, double f) { return v[std::min(v.size() - 1, size_t(f * (v.size() - 1) + 0.5))]; };
  std::printf("TRACE workload=%s page_size=%d ctas=%zu span_us=%.2f last_start_us=%.2f "
              "stream_us_min=%.2f stream_us_p50=%.2f stream_us_max=%.2f stream_us_alone=%.2f (%d) stream_us_shared=%.2f (%d) "
              "streaming_until_us: 95%%=%.2f 75%%=%.2f 50%%=%.2f 25%%=%.2f 0%%=%.2f\n",
              name.c_str(), page_size, n, (end - t0) * 1e-3, (last_start - t0) * 1e-3, took.front(), q(took, 0.5),
              took.back(), n_alone ? alone / n_alone : 0.0, n_alone, n_shared ? shared / n_shared : 0.0, n_shared,
              q(streamed, 0.05), q(streamed, 0.25), q(streamed, 0.5), q(streamed, 0.75), streamed.back());
}

constexpr int kD = 128;

struct Workload {
  std::string name;
  int batch, q_len, kv_len, page_size;
  // Target: max ms (0: none) and min TB/s (0: none), kernel time incl. merge.
  double target_ms, target_tbs;
  // Variants (kernels/variant.h): window_left keys before the diagonal (-1:
  // none; bytes then count the keys in the window), a soft-cap, a sink per head.
  int window_left = -1;
  float soft_cap = 0.f;
  bool sinks = false;
  Fp8Format kv = Fp8Format::kNone;  // FP8 pools of this format
};

// Fills n bf16 values with N(0, 1) (never zeros) from a host table.
void FillRandomBf16(void* dst, size_t n, uint64_t seed) {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> h((size_t{1} << 24) + (size_t{1} << 20));
    std::mt19937_64 rng(12345);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& x : h) {
      float f = nd(rng);
      if (f == 0.f) f = 1e-3f;
      uint32_t u;
      std::memcpy(&u, &f, 4);
      u += 0x7fff + ((u >> 16) & 1);
      x = static_cast<uint16_t>(u >> 16);
    }
    return h;
  }();
  const size_t chunk = size_t{1} << 24;
  const size_t start = (seed * 104729) % (size_t{1} << 20);
  for (size_t off = 0; off < n; off += chunk) {
    const size_t c = std::min(chunk, n - off);
    CHECK_CUDA(cudaMemcpy(static_cast<uint16_t*>(dst) + off, table.data() + start, c * 2, cudaMemcpyHostToDevice));
  }
}

double Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int NumSms() {
  int dev = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

int L2Bytes() {
  int dev = 0, l2 = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  return l2;
}

// Times fn (one launch sequence on the default stream) with events; queued:
// behind a spin kernel (device time alone, see the top of the file).
template <typename Fn>
double TimeMs(int repeats, Fn&& fn, bool queued = false) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<float> times;
  for (int r = 0; r < repeats + 5; ++r) {
    if (queued) CHECK_CUDA(LaunchGpuSpin(50));
    CHECK_CUDA(cudaEventRecord(e0));
    fn(r);
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 5) times.push_back(ms);
  }
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  return Median(times);
}

struct Row {
  std::string name;
  Fp8Format kv;
  int page_size;
  double ms, tbs, merge_share, prefill_ms;
  double ms_queued, tbs_queued;
  double target_ms, target_tbs;
};

Row RunWorkload(const Workload& w, int repeats) {
  const int kKvh = g_kv_heads, kH = 8 * g_kv_heads;
  KvGeometry g;
  g.num_layers = 1;
  g.page_size = w.page_size;
  g.num_qo_heads = kH;
  g.num_kv_heads = kKvh;
  g.head_dim = kD;
  g.dtype = KvDType::kBf16;
  g.kv_fp8 = w.kv;
  const bool fp8 = g.KvIsFp8();
  const int pages_per_seq = (w.kv_len + w.page_size - 1) / w.page_size;
  g.num_pages = pages_per_seq * w.batch;

  std::vector<PrefillSeq> seqs(w.batch);
  std::vector<int32_t> idx(size_t(pages_per_seq) * w.batch);
  std::iota(idx.begin(), idx.end(), 0);
  std::mt19937_64 rng(42);
  std::shuffle(idx.begin(), idx.end(), rng);  // random page order
  for (int b = 0; b < w.batch; ++b) {
    PrefillSeq& s = seqs[b];
    s.q_start = b * w.q_len;
    s.q_len = w.q_len;
    s.kv_start = b * pages_per_seq;
    s.kv_len = w.kv_len;
    s.sm_scale = 1.f / std::sqrt(float(kD));
    s.causal = 1;
    s.window_left = w.window_left;
    s.soft_cap = w.soft_cap;
    s.sink_index = w.sinks ? 0 : -1;
  }
  const int keys_read = w.window_left >= 0 ? std::min(w.kv_len, w.window_left + w.q_len) : w.kv_len;
  const double kv_bytes = 2.0 * w.batch * double(keys_read) * kKvh * kD * g.KvElemBytes();

  // ---- Plans: decode (heuristic, and unsplit for A/B), prefill variant 1 / 0.
  const int sms = NumSms();
  DecodePlanOptions dopt;
  dopt.num_sms = sms;
  const int tile_rows = DecodeTileRows(kD, w.q_len * (kH / kKvh));
  dopt.ctas_per_sm = DecodeCtasPerSm(kD, g.dtype, tile_rows, g.kv_fp8);
  // --four_ctas=0: the plan made for the three-CTA kernel alone.
  dopt.wide_ctas_per_sm = g_four_ctas == 0 ? 0 : DecodeWideCtasPerSm(kD, g.dtype, tile_rows, g.kv_fp8);
  dopt.max_cluster = DecodeMaxCluster(kD, g.dtype, tile_rows, g.kv_fp8);
  DecodePlan dplan;
  BuildDecodePlan(seqs.data(), w.batch, g, dopt, &dplan);
  DecodePlanOptions nopt = dopt;
  nopt.no_split = true;
  DecodePlan nplan;
  BuildDecodePlan(seqs.data(), w.batch, g, nopt, &nplan);

  const size_t q_elems = size_t(w.batch) * w.q_len * kH * kD;
  const size_t pool_elems = g.PoolElems();
  const double set_bytes = double(q_elems) * 2 + 2.0 * pool_elems * g.KvElemBytes();
  const int sets = std::clamp(static_cast<int>(std::ceil(4.0 * L2Bytes() / set_bytes)), 1, 16);
  std::vector<void*> qs(sets), ks(sets), vs(sets);
  for (int i = 0; i < sets; ++i) {
    CHECK_CUDA(cudaMalloc(&qs[i], q_elems * 2));
    CHECK_CUDA(cudaMalloc(&ks[i], pool_elems * 2));
    CHECK_CUDA(cudaMalloc(&vs[i], pool_elems * 2));
    FillRandomBf16(qs[i], q_elems, 1 + i);
    // FP8 pools: the random bf16 bytes' high halves (sign, exponent, top
    // mantissa bits) masked to finite values of magnitude below 2.
    FillRandomBf16(ks[i], fp8 ? pool_elems / 2 : pool_elems, 100 + i);
    FillRandomBf16(vs[i], fp8 ? pool_elems / 2 : pool_elems, 200 + i);
    if (fp8) {
      for (void* pool : {ks[i], vs[i]}) {
        std::vector<uint8_t> h(pool_elems);
        CHECK_CUDA(cudaMemcpy(h.data(), pool, pool_elems, cudaMemcpyDeviceToHost));
        for (auto& b : h) b &= 0xBF;
        CHECK_CUDA(cudaMemcpy(pool, h.data(), pool_elems, cudaMemcpyHostToDevice));
      }
    }
  }
  auto dev_copy = [](const void* src, size_t bytes) {
    void* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(bytes, 4)));
    if (bytes > 0) CHECK_CUDA(cudaMemcpy(d, src, bytes, cudaMemcpyHostToDevice));
    return d;
  };
  void* o_dec = nullptr;
  void* o_pre = nullptr;
  float* lse = nullptr;
  CHECK_CUDA(cudaMalloc(&o_dec, q_elems * 2));
  CHECK_CUDA(cudaMalloc(&o_pre, q_elems * 2));
  CHECK_CUDA(cudaMalloc(&lse, size_t(w.batch) * w.q_len * kH * 4));
  void* d_idx = dev_copy(idx.data(), idx.size() * 4);
  void* d_seqs = dev_copy(seqs.data(), seqs.size() * sizeof(PrefillSeq));
  void* d_items = dev_copy(dplan.items.data(), dplan.items.size() * sizeof(DecodeWorkItem));
  void* d_nitems = dev_copy(nplan.items.data(), nplan.items.size() * sizeof(DecodeWorkItem));
  std::vector<float> h_sinks(kH);
  for (int h = 0; h < kH; ++h) h_sinks[h] = 0.25f * (h % 8);
  void* d_sinks = dev_copy(h_sinks.data(), h_sinks.size() * sizeof(float));
  std::vector<float> h_scales(kKvh);
  for (int h = 0; h < kKvh; ++h) h_scales[h] = 0.5f + 0.125f * h;
  void* d_scales = dev_copy(h_scales.data(), h_scales.size() * sizeof(float));
  float *part_o, *part_lse;
  int32_t* counters;
  CHECK_CUDA(cudaMalloc(&part_o, std::max<int64_t>(dplan.PartOBytes(kD), 4)));
  CHECK_CUDA(cudaMalloc(&part_lse, std::max<int64_t>(dplan.PartLseBytes(), 4)));
  CHECK_CUDA(cudaMalloc(&counters, std::max<int64_t>(dplan.CounterBytes(), 4)));
  CHECK_CUDA(cudaMemset(counters, 0, std::max<int64_t>(dplan.CounterBytes(), 4)));

  auto params = [&](int r, void* o) {
    const int s = r % sets;
    PagedPrefillParams p;
    p.q = qs[s];
    p.o = o;
    p.lse = lse;
    p.k_cache = ks[s];
    p.v_cache = vs[s];
    p.k_scales = fp8 ? static_cast<const float*>(d_scales) : nullptr;
    p.v_scales = fp8 ? static_cast<const float*>(d_scales) : nullptr;
    p.kv_indices = static_cast<int32_t*>(d_idx);
    p.seqs = static_cast<PrefillSeq*>(d_seqs);
    p.sinks = w.sinks ? static_cast<const float*>(d_sinks) : nullptr;
    p.any_soft_cap = AnySoftCap(seqs.data(), w.batch);
    p.num_seqs = w.batch;
    p.total_q = w.batch * w.q_len;
    p.geo = g;
    return p;
  };
  const int n_items = static_cast<int>(dplan.items.size());
  auto run_decode = [&](int r) {
    CHECK_CUDA(PagedDecodeCuda(params(r, o_dec), dplan.tile_rows, static_cast<DecodeWorkItem*>(d_items), n_items,
                               part_o, part_lse, counters, nullptr,
                               DecodeLaunchOptions{dplan.cluster, false, g_four_ctas}));
  };
  const double ms_queued = TimeMs(repeats, run_decode, /*queued=*/true);
  const double ms = TimeMs(repeats, run_decode);
  // The last timed run used set (repeats + 4) % sets: keep its output.
  const int last_set = (repeats + 4) % sets;
  std::vector<uint16_t> h_dec(q_elems);
  CHECK_CUDA(cudaMemcpy(h_dec.data(), o_dec, q_elems * 2, cudaMemcpyDeviceToHost));
  std::vector<float> h_lse(size_t(w.batch) * w.q_len * kH);
  CHECK_CUDA(cudaMemcpy(h_lse.data(), lse, h_lse.size() * 4, cudaMemcpyDeviceToHost));
  for (float x : h_lse) {
    if (!std::isfinite(x)) {
      std::fprintf(stderr, "non-finite LSE in %s\n", w.name.c_str());
      std::exit(1);
    }
  }
  double ms_nomerge = ms;
  if (dplan.split_tiles > 0) {
    ms_nomerge = TimeMs(repeats, [&](int r) {
      CHECK_CUDA(PagedDecodeCuda(params(r, o_dec), dplan.tile_rows, static_cast<DecodeWorkItem*>(d_items), n_items,
                                 part_o, part_lse, counters, nullptr,
                                 DecodeLaunchOptions{0, /*skip_merge=*/true, g_four_ctas}));
    });
  }
  const double merge_share = std::max(0.0, (ms - ms_nomerge) / ms);
  if (g_trace && dplan.cluster <= 1) {
    unsigned long long* d_trace = nullptr;
    const size_t words = size_t(n_items) * kDecodeTraceWords;
    CHECK_CUDA(cudaMalloc(&d_trace, words * sizeof(unsigned long long)));
    CHECK_CUDA(cudaMemset(d_trace, 0, words * sizeof(unsigned long long)));
    DecodeLaunchOptions traced{dplan.cluster, false, g_four_ctas};
    traced.trace = d_trace;
    CHECK_CUDA(PagedDecodeCuda(params(0, o_dec), dplan.tile_rows, static_cast<DecodeWorkItem*>(d_items), n_items,
                               part_o, part_lse, counters, nullptr, traced));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<unsigned long long> h_trace(words);
    CHECK_CUDA(cudaMemcpy(h_trace.data(), d_trace, words * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(d_trace));
    PrintTrace(w.name, w.page_size, h_trace);
  }
  std::printf("RESULT kernel=decode workload=%s kv_dtype=%s kv_heads=%d batch=%d q=%d kv=%d page_size=%d ms=%.4f kv_tbs=%.3f "
              "ms_queued=%.4f kv_tbs_queued=%.3f items=%d "
              "tile_rows=%d chunk=%d split_tiles=%d cluster=%d ctas_per_sm=%d wide_ctas_per_sm=%d four_ctas=%d ms_without_merge=%.4f "
              "merge_share=%.3f\n",
              w.name.c_str(), fp8 ? Fp8FormatName(g.kv_fp8) : "bf16", kKvh, w.batch, w.q_len, w.kv_len, w.page_size, ms,
              kv_bytes / (ms * 1e-3) / 1e12, ms_queued,
              kv_bytes / (ms_queued * 1e-3) / 1e12, n_items,
              dplan.tile_rows, dplan.chunk_len, dplan.split_tiles, dplan.cluster, dopt.ctas_per_sm, dopt.wide_ctas_per_sm, g_four_ctas,
              ms_nomerge, merge_share);
  std::fflush(stdout);
  if (dplan.split_tiles > 0 || dplan.cluster > 1) {
    const double ms_n = TimeMs(repeats, [&](int r) {
      CHECK_CUDA(PagedDecodeCuda(params(r, o_dec), nplan.tile_rows, static_cast<DecodeWorkItem*>(d_nitems),
                                 static_cast<int>(nplan.items.size()), nullptr, nullptr, nullptr, nullptr));
    });
    std::printf("RESULT kernel=decode_nosplit workload=%s page_size=%d ms=%.4f kv_tbs=%.3f items=%zu\n",
                w.name.c_str(), w.page_size, ms_n, kv_bytes / (ms_n * 1e-3) / 1e12, nplan.items.size());
    std::fflush(stdout);
  }

  // ---- Chunk sweep (page_size 1 only): forced chunk lengths, to refit the
  // plan's cost model (DecodePlanOptions) from one run.
  if (w.page_size == 1 && w.q_len == 1 && w.batch != 128 && (fp8 || w.batch != 256)) {
    for (int k : {2, 3, 4, 6, 8, 16, 32}) {
      DecodePlanOptions fopt = dopt;
      fopt.force_chunk = (w.kv_len + k - 1) / k;
      DecodePlan fplan;
      BuildDecodePlan(seqs.data(), w.batch, g, fopt, &fplan);
      if (fplan.split_tiles == 0) continue;
      float *f_part_o, *f_part_lse;
      int32_t* f_counters;
      CHECK_CUDA(cudaMalloc(&f_part_o, std::max<int64_t>(fplan.PartOBytes(kD), 4)));
      CHECK_CUDA(cudaMalloc(&f_part_lse, std::max<int64_t>(fplan.PartLseBytes(), 4)));
      CHECK_CUDA(cudaMalloc(&f_counters, std::max<int64_t>(fplan.CounterBytes(), 4)));
      CHECK_CUDA(cudaMemset(f_counters, 0, std::max<int64_t>(fplan.CounterBytes(), 4)));
      void* d_fitems = dev_copy(fplan.items.data(), fplan.items.size() * sizeof(DecodeWorkItem));
      const int nf = static_cast<int>(fplan.items.size());
      const double ms_f = TimeMs(repeats, [&](int r) {
        CHECK_CUDA(PagedDecodeCuda(params(r, o_dec), fplan.tile_rows, static_cast<DecodeWorkItem*>(d_fitems), nf,
                                   f_part_o, f_part_lse, f_counters, nullptr));
      });
      std::printf("RESULT kernel=decode_chunk workload=%s page_size=%d chunk=%d items=%d ms=%.4f kv_tbs=%.3f\n",
                  w.name.c_str(), w.page_size, fplan.chunk_len, nf, ms_f, kv_bytes / (ms_f * 1e-3) / 1e12);
      std::fflush(stdout);
      cudaFree(d_fitems);
      cudaFree(f_part_o);
      cudaFree(f_part_lse);
      cudaFree(f_counters);
    }
    // Cluster mode with forced cluster sizes (sm_90): the merge in
    // distributed shared memory instead of the last CTA's pass.
    for (int c : {2, 3, 4, 8, 16}) {
      if (c > dopt.max_cluster) continue;
      DecodePlanOptions copt = dopt;
      copt.force_cluster = c;
      DecodePlan cplan;
      BuildDecodePlan(seqs.data(), w.batch, g, copt, &cplan);
      if (cplan.cluster != c) continue;
      void* d_citems = dev_copy(cplan.items.data(), cplan.items.size() * sizeof(DecodeWorkItem));
      const int ncl = static_cast<int>(cplan.items.size());
      const double ms_c = TimeMs(repeats, [&](int r) {
        CHECK_CUDA(PagedDecodeCuda(params(r, o_dec), cplan.tile_rows, static_cast<DecodeWorkItem*>(d_citems), ncl,
                                   nullptr, nullptr, nullptr, nullptr, DecodeLaunchOptions{c, false}));
      });
      std::printf("RESULT kernel=decode_cluster workload=%s page_size=%d cluster=%d chunk=%d items=%d ms=%.4f "
                  "kv_tbs=%.3f\n",
                  w.name.c_str(), w.page_size, c, cplan.chunk_len, ncl, ms_c, kv_bytes / (ms_c * 1e-3) / 1e12);
      std::fflush(stdout);
      cudaFree(d_citems);
    }
  }

  // ---- The prefill kernel on the same inputs (variants 1: 64 rows, 0: 128).
  double best_prefill = 0;  // none for FP8 pools
  for (int variant : {1, 0}) {
    if (fp8) break;
    if (best_prefill == 0) best_prefill = 1e30;
    PrefillPlanOptions popt;
    popt.num_sms = sms;
    const PrefillKernel pk = variant == 1 ? PrefillKernel::kSm80Rows64 : PrefillKernel::kSm80;
    popt.ctas_per_sm = PrefillCtasPerSm(pk, kD, KvDType::kBf16);
    popt.tile_rows = PrefillTileRows(pk, kD);
    popt.max_partial_pairs = int64_t{4} * popt.num_sms * popt.ctas_per_sm * popt.tile_rows;
    PrefillPlan pplan;
    BuildPrefillPlan(seqs.data(), w.batch, g, popt, &pplan);
    void* p_items = dev_copy(pplan.items.data(), pplan.items.size() * sizeof(PrefillWorkItem));
    void* p_merges = dev_copy(pplan.merges.data(), pplan.merges.size() * sizeof(SplitMergeSeq));
    float *pp_o, *pp_lse;
    CHECK_CUDA(cudaMalloc(&pp_o, std::max<int64_t>(pplan.partial_pairs, 1) * kD * 4));
    CHECK_CUDA(cudaMalloc(&pp_lse, std::max<int64_t>(pplan.partial_pairs, 1) * 4));
    const int np = static_cast<int>(pplan.items.size());
    const double pms = TimeMs(repeats, [&](int r) {
      const PagedPrefillParams p = params(r, o_pre);
      CHECK_CUDA(PagedPrefillCuda(p, static_cast<PrefillWorkItem*>(p_items), np, pp_o, pp_lse, pk, nullptr));
      if (!pplan.merges.empty()) {
        CHECK_CUDA(MergeSplitsCuda(p, static_cast<SplitMergeSeq*>(p_merges), static_cast<int>(pplan.merges.size()),
                                   pplan.merge_pairs, pp_o, pp_lse, nullptr));
      }
    });
    best_prefill = std::min(best_prefill, pms);
    // Cross-check on the same input set: decode vs prefill outputs.
    const PagedPrefillParams p = params(last_set, o_pre);
    CHECK_CUDA(PagedPrefillCuda(p, static_cast<PrefillWorkItem*>(p_items), np, pp_o, pp_lse, pk, nullptr));
    if (!pplan.merges.empty()) {
      CHECK_CUDA(MergeSplitsCuda(p, static_cast<SplitMergeSeq*>(p_merges), static_cast<int>(pplan.merges.size()),
                                 pplan.merge_pairs, pp_o, pp_lse, nullptr));
    }
    std::vector<uint16_t> h_pre(q_elems);
    CHECK_CUDA(cudaMemcpy(h_pre.data(), o_pre, q_elems * 2, cudaMemcpyDeviceToHost));
    double max_diff = 0;
    for (size_t i = 0; i < q_elems; ++i) {
      auto f = [](uint16_t u) {
        const uint32_t x = uint32_t{u} << 16;
        float y;
        std::memcpy(&y, &x, 4);
        return double(y);
      };
      const double d = std::fabs(f(h_dec[i]) - f(h_pre[i]));
      max_diff = std::isnan(d) ? INFINITY : std::max(max_diff, d);
    }
    std::printf("RESULT kernel=prefill workload=%s page_size=%d variant=%d ms=%.4f kv_tbs=%.3f items=%d split=%d "
                "max_abs_diff_vs_decode=%.3g\n",
                w.name.c_str(), w.page_size, variant, pms, kv_bytes / (pms * 1e-3) / 1e12, np,
                pplan.merges.empty() ? 0 : 1, max_diff);
    std::fflush(stdout);
    cudaFree(p_items);
    cudaFree(p_merges);
    cudaFree(pp_o);
    cudaFree(pp_lse);
  }

  for (int i = 0; i < sets; ++i) {
    cudaFree(qs[i]);
    cudaFree(ks[i]);
    cudaFree(vs[i]);
  }
  for (void* p : {o_dec, o_pre, static_cast<void*>(lse), d_idx, d_seqs, d_items, d_nitems, d_sinks, d_scales,
                  static_cast<void*>(part_o), static_cast<void*>(part_lse), static_cast<void*>(counters)}) {
    cudaFree(p);
  }
  CHECK_CUDA(cudaGetLastError());
  return {w.name, w.kv, w.page_size, ms, kv_bytes / (ms * 1e-3) / 1e12, merge_share, best_prefill,
          ms_queued, kv_bytes / (ms_queued * 1e-3) / 1e12, w.target_ms, w.target_tbs};
}

// cudaMemcpy device to device of 1 GiB: bytes read + written / time.
double CopyCeilingTbs(int repeats) {
  const size_t bytes = size_t{1} << 30;
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  const double ms = TimeMs(repeats, [&](int) { CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
  cudaFree(a);
  cudaFree(b);
  const double tbs = 2.0 * bytes / (ms * 1e-3) / 1e12;
  std::printf("RESULT kernel=copy bytes=%zu ms=%.4f tbs=%.3f\n", bytes, ms, tbs);
  std::fflush(stdout);
  return tbs;
}

// A 4-byte cudaMemsetAsync (one tiny kernel) timed the same way: the launch /
// event floor under every latency figure of this bench.
double EmptyLaunchMs(int repeats, bool queued) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, 4));
  const double ms = TimeMs(repeats, [&](int) { CHECK_CUDA(cudaMemsetAsync(p, 0, 4)); }, queued);
  cudaFree(p);
  std::printf("RESULT kernel=empty queued=%d ms=%.4f\n", queued ? 1 : 0, ms);
  std::fflush(stdout);
  return ms;
}

std::string MetPair(const char* a, const char* b) { return std::string(a) + " / " + b; }

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  using namespace attnserve;
  bool quick = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strncmp(argv[i], "--only=", 7) == 0) {
      only = argv[i] + 7;
    } else if (std::strcmp(argv[i], "--four_ctas=-1") == 0 || std::strcmp(argv[i], "--four_ctas=0") == 0 ||
               std::strcmp(argv[i], "--four_ctas=1") == 0) {
      g_four_ctas = std::atoi(argv[i] + 12);
    } else if (std::strncmp(argv[i], "--kv_heads=", 11) == 0) {
      if (!BenchIntArg("--kv_heads", argv[i] + 11, 1, 64, &g_kv_heads)) return 2;
    } else if (std::strcmp(argv[i], "--trace") == 0) {
      g_trace = true;
    } else if (std::strncmp(argv[i], "--trace_dump=", 13) == 0) {
      g_trace_dump = argv[i] + 13;
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--only=WORKLOAD] [--four_ctas=-1|0|1] [--kv_heads=1..64] [--trace] [--trace_dump=PATH]\n",
                   argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  const int reps = quick ? 10 : 50;
  const double copy_tbs = CopyCeilingTbs(reps);
  const double empty_ms = EmptyLaunchMs(reps, false);
  const double empty_queued_ms = EmptyLaunchMs(reps, true);
  // name, batch, q_len, kv_len, page_size, target ms (max), target TB/s (min)
  const std::vector<Workload> workloads = {
      {"decode_b64", 64, 1, 4096, 1, 0.135, 0},     {"decode_b64", 64, 1, 4096, 16, 0.135, 0},
      {"decode_b128", 128, 1, 4096, 1, 0, 0},       {"decode_b256", 256, 1, 4096, 1, 0.54, 0},
      {"decode_b256", 256, 1, 4096, 16, 0.54, 0},
      {"decode_b8_128k", 8, 1, 131072, 1, 0, 3.8},  {"decode_b8_128k", 8, 1, 131072, 16, 0, 3.8},
      {"decode_b1", 1, 1, 4096, 1, 0.015, 0},       {"decode_b1", 1, 1, 4096, 16, 0.015, 0},
      {"spec_b64_q4", 64, 4, 4096, 1, 0, 3.8},      {"spec_b64_q4", 64, 4, 4096, 16, 0, 3.8},
      // Variants: a 128-key window over 32k keys against 128 keys; soft-cap
      // and sinks against decode_b64.
      {"win128_b64_32k", 64, 1, 32768, 16, 0, 0, 127}, {"decode_b64_128", 64, 1, 128, 16, 0, 0},
      {"decode_b64_cap", 64, 1, 4096, 16, 0, 0, -1, 30.f}, {"decode_b64_sink", 64, 1, 4096, 16, 0, 0, -1, 0.f, true},
      // FP8 pools (issue #32's targets), bf16 queries.
      {"decode_b64_e4m3", 64, 1, 4096, 1, 0.075, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b64_e4m3", 64, 1, 4096, 16, 0.075, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b64_e5m2", 64, 1, 4096, 16, 0.075, 0, -1, 0.f, false, Fp8Format::kE5m2},
      // decode_b64 at 2k and 8k keys, both pool types: the launch's fixed
      // cost and its streaming rate (a line through the three lengths).
      {"decode_b64_2k_e4m3", 64, 1, 2048, 16, 0, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b64_8k_e4m3", 64, 1, 8192, 16, 0, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b64_2k", 64, 1, 2048, 16, 0, 0},
      {"decode_b64_8k", 64, 1, 8192, 16, 0, 0},
      {"decode_b256_e4m3", 256, 1, 4096, 1, 0.28, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b256_e4m3", 256, 1, 4096, 16, 0.28, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b8_128k_e4m3", 8, 1, 131072, 1, 0.28, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b8_128k_e4m3", 8, 1, 131072, 16, 0.28, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b1_e4m3", 1, 1, 4096, 16, 0, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"spec_b64_q4_e4m3", 64, 4, 4096, 16, 0, 0, -1, 0.f, false, Fp8Format::kE4m3},
      // Around the three-CTA kernel's slots (396 on an H200): 400, 512 and
      // 2,048 items (DecodeLaunchOptions::four_ctas).
      {"decode_b100_e4m3", 100, 1, 4096, 16, 0, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b128_e4m3", 128, 1, 4096, 16, 0, 0, -1, 0.f, false, Fp8Format::kE4m3},
      {"decode_b512_e4m3", 512, 1, 4096, 16, 0, 0, -1, 0.f, false, Fp8Format::kE4m3},
  };
  std::vector<Row> rows;
  for (const auto& w : workloads) {
    if (only.empty() || ("," + only + ",").find("," + w.name + ",") != std::string::npos) {
      rows.push_back(RunWorkload(w, reps));
    }
  }
  if (rows.empty()) {
    std::fprintf(stderr, "--only=%s names no workload\n", only.c_str());
    return 2;
  }

  std::printf("\ncopy ceiling (cudaMemcpy D2D 1 GiB, read + write): %.2f TB/s\n", copy_tbs);
  std::printf("4-byte memset kernel, timed as the workloads (launch + event floor): %.4f ms idle, %.4f ms queued\n",
              empty_ms, empty_queued_ms);
  std::printf("ms: idle device (host launch latency included); queued: behind a spin kernel (device time)\n");
  std::printf("%-19s %3s %9s %8s %9s %8s %7s %11s %8s %-16s %s\n", "workload", "ps", "ms", "TB/s", "ms_queued",
              "TB/s", "merge%", "prefill_ms", "speedup", "target", "met (idle / queued)");
  for (const auto& r : rows) {
    char target[64] = "-";
    bool met = true, met_queued = true;
    if (r.target_ms > 0) {
      std::snprintf(target, sizeof(target), "<= %.3f ms", r.target_ms);
      met = r.ms <= r.target_ms;
      met_queued = r.ms_queued <= r.target_ms;
    } else if (r.target_tbs > 0) {
      std::snprintf(target, sizeof(target), ">= %.1f TB/s", r.target_tbs);
      met = r.tbs >= r.target_tbs;
      met_queued = r.tbs_queued >= r.target_tbs;
    }
    std::printf("%-19s %3d %9.4f %8.2f %9.4f %8.2f %6.1f%% %11.4f %7.2fx %-16s %s\n", r.name.c_str(), r.page_size,
                r.ms, r.tbs, r.ms_queued, r.tbs_queued, 100 * r.merge_share, r.prefill_ms, r.prefill_ms / r.ms,
                target,
                (r.target_ms > 0 || r.target_tbs > 0)
                    ? MetPair(met ? "yes" : "NO", met_queued ? "yes" : "NO").c_str()
                    : "");
  }
  return 0;
}
