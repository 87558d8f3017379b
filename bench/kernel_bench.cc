// attnserve_kernel_bench: times the CUDA kernels on the ANCHORS.md workloads.
//
// Paged prefill (one attention launch + the merge launch when split) for the
// four anchor workloads and a sweep of sequence lengths / decode batch sizes,
// 32 query heads / 4 KV heads / head_dim 128 / bf16 / causal, page ids in
// random order, page_size 1 and 16; and the N-way merge at 65,536 and 512
// tokens x 32 heads x 128. CUDA events, warm-up, median of repeats, input
// sets rotated when one set fits in L2. FLOPs as ANCHORS.md counts them:
// 4 * head_dim * num_qo_heads * (visible (query, key) pairs).
//
// Usage: attnserve_kernel_bench [--quick]
//          [--kernel=auto|sm80|sm80_rows64|sm90|sm90_overlap|sm90_overlap_nopp|sm90_fp8q]
//          [--merge-only] [--workload=NAME[,NAME...]] [--page_sizes=1,16,64]
//          [--kv_dtype=bf16|fp8_e4m3|fp8_e5m2] [--q_dtype=bf16|fp16]
// --kernel=auto (the default) times what the server picks per workload
// (ChoosePrefillKernel); a name forces that kernel (sm90*: sm_90 devices
// only).
// --workload times only the named anchor workloads (long, batch, prefix,
// decode; the variants long_cap, long_sink, batch_cap, batch_sink,
// prefix_cap, prefix_sink, long32k and win4k_32k) at page_size 1 and 16 (--page_sizes=1,16,64 to choose) with the
// default plan, and `sweep` the
// sequence-length sweep at page_size 1 (16k query tokens as 32 x 512 ..
// 1 x 16384, causal); no merge. sweep_lenN is one point of the sweep, run
// like the anchors (--page_sizes, --trace).
// --trace=N (with --kernel=sm90_overlap --workload=...): after timing, runs
// the workload once more through the traced kernel (PagedPrefillSm90Traced;
// bf16 or FP8 pools) and prints where the first N CTAs' cycles went, phase by
// phase.
// --kv_dtype: the prefill workloads' KV pools in FP8 (N(0, 1) values, scales
// 1.0; queries stay bf16): sm90_overlap and the sm80 kernels read them
// (ChoosePrefillKernel picks as for 16-bit pools).
// --q_dtype=fp16: the queries (and a 16-bit pool) in fp16, filled with the
// bf16 generator's bit patterns read as fp16 (finite, magnitudes about 0.9
// to 4): for timing only, e.g. FP8 pools without the bf16 queries'
// conversion to fp16.
// Prints one "RESULT key=value ..." line per measurement, then a table.
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
#include "kernels/fp8.h"
#include "kernels/merge/merge_cuda.h"
#include "kernels/plan/kernel_select.h"
#include "kernels/prefill_cuda.h"
#include "kernels/sm90/prefill_sm90.h"
#include "kernels/variant.h"

namespace attnserve {
namespace {

constexpr int kH = 32, kKvh = 4, kD = 128;

struct Workload {
  std::string name;
  int batch, q_len, kv_len;
  // Variants (kernels/variant.h): a window of window_left keys before the
  // diagonal (-1: none), a soft-cap (0: none), one set of sinks.
  int window_left = -1;
  float soft_cap = 0.f;
  bool sinks = false;
};

struct Result {
  std::string name;
  int page_size = 0;
  std::string kernel;
  int section_mb = 0;
  double ms = 0;
  double tflops = 0;
  double kv_tbs = 0;  // K/V bytes read / time
  size_t items = 0;
  bool split = false;
};

// Fills n bf16 values with N(0, 1) (never zeros): one host table of 2^24
// values drawn once, uploaded from an offset that depends on seed.
void FillRandomBf16(void* dst, size_t n, uint64_t seed) {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> h((size_t{1} << 24) + (size_t{1} << 20));
    std::mt19937_64 rng(12345);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& x : h) {
      float f = nd(rng);
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
    CHECK_CUDA(cudaMemcpy(static_cast<uint16_t*>(dst) + off, table.data() + start, c * 2,
                          cudaMemcpyHostToDevice));
  }
}

// --kv_dtype: the prefill workloads' pools (kNone: bf16, as the queries).
Fp8Format g_kv_fp8 = Fp8Format::kNone;
// --q_dtype: the queries' dtype (bf16 or fp16).
KvDType g_q_dtype = KvDType::kBf16;

// Fills n FP8 bytes of format f with N(0, 1) values quantized by
// kernels/fp8.h (never NaN), as FillRandomBf16.
void FillRandomFp8(void* dst, size_t n, Fp8Format f, uint64_t seed) {
  static std::vector<uint8_t> table[3];
  std::vector<uint8_t>& t = table[static_cast<int>(f)];
  if (t.empty()) {
    t.resize((size_t{1} << 24) + (size_t{1} << 20));
    std::mt19937_64 rng(54321);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& x : t) x = Fp8Quantize(f, nd(rng), 1.f);
  }
  const size_t chunk = size_t{1} << 24;
  const size_t start = (seed * 104729) % (size_t{1} << 20);
  for (size_t off = 0; off < n; off += chunk) {
    const size_t c = std::min(chunk, n - off);
    CHECK_CUDA(cudaMemcpy(static_cast<uint8_t*>(dst) + off, t.data() + start, c, cudaMemcpyHostToDevice));
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

// Mean and median of a list of cycle counts.
struct CycleStats {
  double mean = 0, median = 0;
  size_t n = 0;
};
CycleStats Stats(std::vector<long long> v) {
  CycleStats c;
  c.n = v.size();
  if (v.empty()) return c;
  std::sort(v.begin(), v.end());
  c.median = double(v[v.size() / 2]);
  c.mean = double(std::accumulate(v.begin(), v.end(), 0LL)) / double(v.size());
  return c;
}

// Where the traced CTAs' cycles went (Sm90Trace's stamps): the producer's
// phases per block, each consumer warpgroup's phases per steady turn (turns
// 1 .. its last block - 1, where S_t and P_{t-1} V_{t-1} are issued
// together), the cold start and the whole tile per block.
void PrintTrace(const std::string& name, const std::vector<long long>& tr, int ctas) {
  using Tr = Sm90Trace;
  std::vector<long long> tile_per_block, cold, turn_total;
  std::vector<std::vector<long long>> prod(Tr::kProducerPoints), cons(Tr::kConsumerPoints - 1);
  std::vector<long long> prod_period;
  for (int c = 0; c < ctas; ++c) {
    const long long* h = tr.data() + size_t(c) * Tr::kLongsPerCta;
    const int nb = static_cast<int>(h[4]);
    if (nb <= 0 || h[1] == 0) continue;
    const long long end = std::max(h[2], h[3]);
    tile_per_block.push_back((end - h[1]) / nb);
    const long long* c0 = h + Tr::ConsumerAt(0);
    if (c0[1] != 0) cold.push_back(c0[1] - h[1]);
    const long long* p = h + Tr::kProducerAt;
    for (int b = 0; b < std::min(nb, Tr::kTurns); ++b) {
      const long long* pb = p + b * Tr::kProducerPoints;
      for (int k = 1; k < Tr::kProducerPoints; ++k) prod[k - 1].push_back(pb[k] - pb[k - 1]);
      if (b + 1 < std::min(nb, Tr::kTurns)) prod_period.push_back(pb[Tr::kProducerPoints] - pb[0]);
    }
    for (int cw = 0; cw < 2; ++cw) {
      const long long* cb = h + Tr::ConsumerAt(cw);
      const int wb = static_cast<int>(h[5 + cw]);
      for (int t = 1; t < std::min(wb, Tr::kTurns); ++t) {
        const long long* ct = cb + t * Tr::kConsumerPoints;
        for (int k = 1; k < Tr::kConsumerPoints; ++k) cons[k - 1].push_back(ct[k] - ct[k - 1]);
        if (t + 1 < std::min(wb, Tr::kTurns)) turn_total.push_back(ct[Tr::kConsumerPoints] - ct[0]);
      }
    }
  }
  auto line = [&](const char* phase, const std::vector<long long>& v) {
    const CycleStats st = Stats(v);
    std::printf("TRACE workload=%s phase=%s mean=%.0f median=%.0f n=%zu\n", name.c_str(), phase, st.mean,
                st.median, st.n);
  };
  line("tile_cycles_per_block", tile_per_block);
  line("cold_start_to_first_k", cold);
  line("consumer_turn", turn_total);
  const char* cnames[] = {"c_wait_k_v", "c_wait_turn", "c_issue", "c_wait_s", "c_softmax", "c_wait_pv", "c_pack"};
  for (int k = 0; k < Tr::kConsumerPoints - 1; ++k) line(cnames[k], cons[k]);
  line("producer_block", prod_period);
  const char* pnames[] = {"p_share_slots", "p_wait_k_free", "p_issue_k", "p_wait_v_free", "p_issue_v"};
  for (int k = 0; k < Tr::kProducerPoints - 1; ++k) line(pnames[k], prod[k]);
  // Tiles after each CTA's first (consumer warpgroup 0): from the last
  // tile's epilogue to this one's start, the waits for Q and for K_0 and the
  // first turn, the turns per block, the epilogue; and all of it per block.
  std::vector<long long> gap, q_wait, q_land, q_convert, k0_wait, turns_per_block, epilogue, tile_per_block_all, blocks;
  // Relative to the previous tile's last turn of consumer warpgroup 0: its
  // epilogue's row sums done and epilogue end, warpgroup 1's last turn and
  // epilogue end, the producer's start of this tile and its K_0 and Q
  // issue, and when warpgroup 0 saw Q land.
  std::vector<long long> r_epi_sums, r_epi_end, r_wg1_last, r_wg1_epi_end, r_p_start, r_p_k0, r_p_q, r_q_landed;
  for (int c = 0; c < ctas; ++c) {
    const long long* tl = tr.data() + size_t(c) * Tr::kLongsPerCta + Tr::kTileAt;
    for (int n = 1; n < Tr::kTiles; ++n) {
      const long long* a = tl + n * Tr::kTilePoints;
      const long long* prev = a - Tr::kTilePoints;
      const int nb = static_cast<int>(a[5]);
      if (a[0] == 0 || a[4] == 0 || nb <= 0 || a[1] == 0 || a[2] == 0) break;
      gap.push_back(a[0] - prev[4]);
      q_wait.push_back(a[1] - a[0]);
      if (a[12] != 0) {
        q_land.push_back(a[12] - a[0]);
        q_convert.push_back(a[1] - a[12]);
      }
      k0_wait.push_back(a[2] - a[1]);
      turns_per_block.push_back((a[3] - a[2]) / nb);
      epilogue.push_back(a[4] - a[3]);
      tile_per_block_all.push_back((a[4] - prev[4]) / nb);
      blocks.push_back(nb);
      const long long t0 = prev[3];
      r_epi_sums.push_back(prev[10] - t0);
      r_epi_end.push_back(prev[4] - t0);
      r_wg1_last.push_back(prev[11] - t0);
      r_wg1_epi_end.push_back(prev[9] - t0);
      r_p_start.push_back(a[6] - t0);
      r_p_k0.push_back(a[8] - t0);
      r_p_q.push_back(a[7] - t0);
      r_q_landed.push_back(a[1] - t0);
    }
  }
  line("tile_gap_after_epilogue", gap);
  line("tile_wait_q", q_wait);
  line("tile_wait_q_land", q_land);
  line("tile_q_convert", q_convert);
  line("tile_wait_k0_and_turn", k0_wait);
  line("tile_turns_per_block", turns_per_block);
  line("tile_epilogue", epilogue);
  line("tile_blocks", blocks);
  line("tile_all_per_block", tile_per_block_all);
  line("rel_wg0_epilogue_sums", r_epi_sums);
  line("rel_wg0_epilogue_end", r_epi_end);
  line("rel_wg1_last_turn", r_wg1_last);
  line("rel_wg1_epilogue_end", r_wg1_epi_end);
  line("rel_producer_tile_start", r_p_start);
  line("rel_producer_k0_issued", r_p_k0);
  line("rel_producer_q_issued", r_p_q);
  line("rel_wg0_q_landed", r_q_landed);
  std::fflush(stdout);
}

// section_mb: PrefillPlanOptions::l2_section_bytes in MiB (0: plain
// longest-first order); -1 keeps the plan's default.
// forced: the kernel to time, or nullptr for the one the server would pick.
Result RunPrefill(const Workload& w, int page_size, const PrefillKernel* forced, int repeats,
                  int section_mb = -1, int trace_ctas = 0) {
  Result res;
  res.name = w.name;
  res.page_size = page_size;
  KvGeometry g;
  g.num_layers = 1;
  g.page_size = page_size;
  g.num_qo_heads = kH;
  g.num_kv_heads = kKvh;
  g.head_dim = kD;
  g.dtype = g_q_dtype;
  g.kv_fp8 = g_kv_fp8;
  const bool fp8 = g.KvIsFp8();
  const int pages_per_seq = (w.kv_len + page_size - 1) / page_size;
  g.num_pages = pages_per_seq * w.batch;

  std::vector<PrefillSeq> seqs(w.batch);
  std::vector<int32_t> idx(size_t(pages_per_seq) * w.batch);
  std::iota(idx.begin(), idx.end(), 0);
  std::mt19937_64 rng(42);
  std::shuffle(idx.begin(), idx.end(), rng);  // random page order
  double pairs = 0;
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
    for (int i = 0; i < w.q_len; ++i) pairs += RowKeys(s, i).size();  // visible pairs
  }
  const double flops = 4.0 * kD * kH * pairs;
  const double kv_bytes = 2.0 * w.batch * double(w.kv_len) * kKvh * kD * (fp8 ? 1 : 2);

  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const PrefillKernel kernel =
      forced != nullptr ? *forced
                        : ChoosePrefillKernel(g, PrefillDevice{prop.major, prop.minor}, int64_t{w.q_len} * (kH / kKvh),
                                              PrefillFamily::kAuto, w.kv_len);  // mean keys per row, as the server's packer counts
  res.kernel = PrefillKernelName(kernel);
  PrefillPlanOptions opt;
  opt.num_sms = NumSms();
  opt.ctas_per_sm = PrefillCtasPerSm(kernel, kD, g.dtype, g.kv_fp8);
  opt.tile_rows = PrefillTileRows(kernel, kD);
  opt.max_partial_pairs = int64_t{4} * opt.num_sms * opt.ctas_per_sm * opt.tile_rows;
  opt.persistent_ctas = PrefillPersistentCtas(kernel, opt.num_sms, opt.ctas_per_sm);
  if (section_mb >= 0) opt.l2_section_bytes = int64_t{section_mb} << 20;
  res.section_mb = static_cast<int>(opt.l2_section_bytes >> 20);
  PrefillPlan plan;
  BuildPrefillPlan(seqs.data(), w.batch, g, opt, &plan);
  res.items = plan.items.size();
  res.split = !plan.merges.empty();

  const size_t q_elems = size_t(w.batch) * w.q_len * kH * kD;
  const size_t pool_elems = g.PoolElems();
  const size_t pool_bytes = pool_elems * (fp8 ? 1 : 2);
  const size_t set_bytes = q_elems * 2 + 2 * pool_bytes;
  const int sets = set_bytes * 2 < size_t(L2Bytes()) * 4 ? 4 : 1;
  std::vector<void*> qs(sets), ks(sets), vs(sets);
  for (int i = 0; i < sets; ++i) {
    CHECK_CUDA(cudaMalloc(&qs[i], q_elems * 2));
    CHECK_CUDA(cudaMalloc(&ks[i], pool_bytes));
    CHECK_CUDA(cudaMalloc(&vs[i], pool_bytes));
    FillRandomBf16(qs[i], q_elems, 1 + i);
    if (fp8) {  // scales left null: 1.0
      FillRandomFp8(ks[i], pool_bytes, g.kv_fp8, 100 + i);
      FillRandomFp8(vs[i], pool_bytes, g.kv_fp8, 200 + i);
    } else {
      FillRandomBf16(ks[i], pool_elems, 100 + i);
      FillRandomBf16(vs[i], pool_elems, 200 + i);
    }
  }
  void *o, *lse, *d_idx, *d_seqs, *d_items, *d_merges, *part_o, *part_lse, *d_sinks;
  CHECK_CUDA(cudaMalloc(&d_sinks, kH * sizeof(float)));
  {
    std::vector<float> sinks(kH);
    for (int h = 0; h < kH; ++h) sinks[h] = 0.25f * (h % 8);
    CHECK_CUDA(cudaMemcpy(d_sinks, sinks.data(), kH * sizeof(float), cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaMalloc(&o, q_elems * 2));
  CHECK_CUDA(cudaMalloc(&lse, size_t(w.batch) * w.q_len * kH * 4));
  CHECK_CUDA(cudaMalloc(&d_idx, idx.size() * 4));
  CHECK_CUDA(cudaMalloc(&d_seqs, seqs.size() * sizeof(PrefillSeq)));
  CHECK_CUDA(cudaMalloc(&d_items, plan.items.size() * sizeof(PrefillWorkItem)));
  CHECK_CUDA(cudaMalloc(&d_merges, std::max<size_t>(1, plan.merges.size()) * sizeof(SplitMergeSeq)));
  CHECK_CUDA(cudaMalloc(&part_o, std::max<int64_t>(1, plan.partial_pairs) * kD * 4));
  CHECK_CUDA(cudaMalloc(&part_lse, std::max<int64_t>(1, plan.partial_pairs) * 4));
  CHECK_CUDA(cudaMemcpy(d_idx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_seqs, seqs.data(), seqs.size() * sizeof(PrefillSeq), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_items, plan.items.data(), plan.items.size() * sizeof(PrefillWorkItem),
                        cudaMemcpyHostToDevice));
  if (!plan.merges.empty()) {
    CHECK_CUDA(cudaMemcpy(d_merges, plan.merges.data(), plan.merges.size() * sizeof(SplitMergeSeq),
                          cudaMemcpyHostToDevice));
  }
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<float> times;
  // The launch's parameters for input set s.
  auto params = [&](int s) {
    PagedPrefillParams p;
    p.q = qs[s];
    p.o = o;
    p.lse = static_cast<float*>(lse);
    p.k_cache = ks[s];
    p.v_cache = vs[s];
    p.kv_indices = static_cast<int32_t*>(d_idx);
    p.seqs = static_cast<PrefillSeq*>(d_seqs);
    p.sinks = w.sinks ? static_cast<const float*>(d_sinks) : nullptr;
    p.any_soft_cap = AnySoftCap(seqs.data(), w.batch);
    p.mean_kv_per_row = MeanKvPerRow(seqs.data(), w.batch);  // as the server sets it
    p.num_seqs = w.batch;
    p.total_q = w.batch * w.q_len;
    p.geo = g;
    return p;
  };
  for (int r = 0; r < repeats + 3; ++r) {
    const PagedPrefillParams p = params(r % sets);
    CHECK_CUDA(cudaEventRecord(e0));
    CHECK_CUDA(PagedPrefillCuda(p, static_cast<PrefillWorkItem*>(d_items), static_cast<int32_t>(plan.items.size()),
                                static_cast<float*>(part_o), static_cast<float*>(part_lse), kernel, nullptr));
    if (!plan.merges.empty()) {
      CHECK_CUDA(MergeSplitsCuda(p, static_cast<SplitMergeSeq*>(d_merges), static_cast<int32_t>(plan.merges.size()),
                                 plan.merge_pairs, static_cast<float*>(part_o), static_cast<float*>(part_lse),
                                 nullptr));
    }
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 3) times.push_back(ms);
  }
  if (trace_ctas > 0 && kernel == PrefillKernel::kSm90Overlap && !AnySoftCap(seqs.data(), w.batch) && !w.sinks) {
    // One CTA per SM at most (the kernel is persistent): each traces its first tile.
    const int n = std::min<int>({trace_ctas, static_cast<int>(plan.items.size()), NumSms()});
    long long* d_trace = nullptr;
    const size_t trace_bytes = size_t(n) * Sm90Trace::kLongsPerCta * sizeof(long long);
    CHECK_CUDA(cudaMalloc(&d_trace, trace_bytes));
    CHECK_CUDA(cudaMemset(d_trace, 0, trace_bytes));
    CHECK_CUDA(PagedPrefillSm90Traced(params(0), static_cast<PrefillWorkItem*>(d_items), static_cast<int32_t>(plan.items.size()),
                                      static_cast<float*>(part_o), static_cast<float*>(part_lse), d_trace, n, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<long long> h_trace(size_t(n) * Sm90Trace::kLongsPerCta);
    CHECK_CUDA(cudaMemcpy(h_trace.data(), d_trace, trace_bytes, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(d_trace));
    PrintTrace(w.name + "_ps" + std::to_string(page_size), h_trace, n);
  }
  // Sanity: no NaN in the output LSE of the last run.
  std::vector<float> h_lse(size_t(w.batch) * w.q_len * kH);
  CHECK_CUDA(cudaMemcpy(h_lse.data(), lse, h_lse.size() * 4, cudaMemcpyDeviceToHost));
  for (float x : h_lse) {
    if (std::isnan(x)) {
      std::fprintf(stderr, "NaN LSE in %s\n", w.name.c_str());
      std::exit(1);
    }
  }
  res.ms = Median(times);
  res.tflops = flops / (res.ms * 1e-3) / 1e12;
  res.kv_tbs = kv_bytes / (res.ms * 1e-3) / 1e12;
  for (int i = 0; i < sets; ++i) {
    cudaFree(qs[i]);
    cudaFree(ks[i]);
    cudaFree(vs[i]);
  }
  for (void* p : {o, lse, d_idx, d_seqs, d_items, d_merges, part_o, part_lse, d_sinks}) cudaFree(p);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const char* q_name = g.dtype == KvDType::kFp16 ? "fp16" : "bf16";
  std::printf("RESULT kernel=prefill workload=%s kv_dtype=%s q_dtype=%s batch=%d q=%d kv=%d page_size=%d family=%s section_mb=%d "
              "ms=%.4f tflops=%.1f kv_tbs=%.2f items=%zu split=%d\n",
              w.name.c_str(), fp8 ? Fp8FormatName(g.kv_fp8) : q_name, q_name, w.batch, w.q_len, w.kv_len, page_size, res.kernel.c_str(), res.section_mb, res.ms, res.tflops,
              res.kv_tbs, res.items, res.split ? 1 : 0);
  std::fflush(stdout);
  return res;
}

// Two bf16 states (n, 32, 128) -> one; bytes = states read + output written.
void RunMerge(int64_t n, int repeats) {
  const int h = 32, d = 128, ns = 2;
  const size_t elems = size_t(n) * h * d;
  const double bytes = (ns + 1.0) * elems * 2 + (ns + 1.0) * n * h * 4;
  const int sets = bytes * 2 < double(L2Bytes()) * 4 ? 16 : 1;
  struct Set {
    void* v[2];
    float* l[2];
  };
  std::vector<Set> all(sets);
  for (auto& s : all) {
    for (int i = 0; i < ns; ++i) {
      CHECK_CUDA(cudaMalloc(&s.v[i], elems * 2));
      FillRandomBf16(s.v[i], elems, 7 + i);
      CHECK_CUDA(cudaMalloc(&s.l[i], size_t(n) * h * 4));
      std::vector<float> hl(size_t(n) * h);
      std::mt19937 rng(i);
      std::normal_distribution<float> nd(0.f, 2.f);
      for (auto& x : hl) x = nd(rng);
      CHECK_CUDA(cudaMemcpy(s.l[i], hl.data(), hl.size() * 4, cudaMemcpyHostToDevice));
    }
  }
  void *out, *out_lse;
  CHECK_CUDA(cudaMalloc(&out, elems * 2));
  CHECK_CUDA(cudaMalloc(&out_lse, size_t(n) * h * 4));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<float> times;
  for (int r = 0; r < repeats + 3; ++r) {
    const Set& s = all[r % sets];
    MergeStatesParams p;
    const void* vp[2] = {s.v[0], s.v[1]};
    const float* lp[2] = {s.l[0], s.l[1]};
    p.v = vp;
    p.lse = lp;
    p.num_states = ns;
    p.v_out = out;
    p.lse_out = static_cast<float*>(out_lse);
    p.n = n;
    p.h = h;
    p.d = d;
    CHECK_CUDA(cudaEventRecord(e0));
    CHECK_CUDA(MergeStatesCuda(p, nullptr));
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 3) times.push_back(ms);
  }
  const double ms = Median(times);
  std::printf("RESULT kernel=merge tokens=%lld states=2 ms=%.4f us=%.1f tbs=%.2f\n", static_cast<long long>(n), ms,
              ms * 1e3, bytes / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
  for (auto& s : all) {
    for (int i = 0; i < ns; ++i) {
      cudaFree(s.v[i]);
      cudaFree(s.l[i]);
    }
  }
  cudaFree(out);
  cudaFree(out_lse);
}

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  using namespace attnserve;
  bool quick = false;
  bool merge_only = false;
  std::string only_kernel = "auto";
  std::string only_workload;
  int trace_ctas = 0;
  std::vector<int> page_sizes = {1, 16};
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--page_sizes=", 13) == 0) {
      page_sizes.clear();
      std::string list = argv[i] + 13;
      for (size_t at = 0; at <= list.size();) {
        size_t comma = list.find(',', at);
        if (comma == std::string::npos) comma = list.size();
        int ps = 0;
        if (!BenchIntArg("--page_sizes", list.substr(at, comma - at).c_str(), 1, 128, &ps)) return 2;
        page_sizes.push_back(ps);
        at = comma + 1;
      }
    }
    if (std::strncmp(argv[i], "--trace=", 8) == 0 && !BenchIntArg("--trace", argv[i] + 8, 0, 1 << 20, &trace_ctas)) {
      return 2;
    }
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--merge-only") == 0) merge_only = true;
    if (std::strncmp(argv[i], "--kernel=", 9) == 0) only_kernel = argv[i] + 9;
    if (std::strncmp(argv[i], "--workload=", 11) == 0) only_workload = argv[i] + 11;
    if (std::strncmp(argv[i], "--q_dtype=", 10) == 0) {
      const std::string v = argv[i] + 10;
      if (v == "fp16") {
        g_q_dtype = KvDType::kFp16;
      } else if (v != "bf16") {
        std::fprintf(stderr, "--q_dtype=%s: expected bf16 or fp16\n", v.c_str());
        return 2;
      }
    }
    if (std::strncmp(argv[i], "--kv_dtype=", 11) == 0) {
      const std::string v = argv[i] + 11;
      if (v == "fp8_e4m3") {
        g_kv_fp8 = Fp8Format::kE4m3;
      } else if (v == "fp8_e5m2") {
        g_kv_fp8 = Fp8Format::kE5m2;
      } else if (v != "bf16") {
        std::fprintf(stderr, "--kv_dtype=%s: expected bf16, fp8_e4m3 or fp8_e5m2\n", v.c_str());
        return 2;
      }
    }
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  const int reps = quick ? 5 : 20;
  // The anchors, then the variants (TFLOP/s over the pairs rows see): the
  // anchors with a soft-cap of 30 or a sink per head, and a 4,096-key window
  // (row i sees keys i-4095 .. i) over 32k keys beside the full 32k.
  std::vector<Workload> anchors = {
      {"long", 1, 16384, 16384}, {"batch", 16, 2048, 2048}, {"prefix", 32, 512, 4096}, {"decode", 64, 1, 4096}};
  for (const char* base : {"long", "batch", "prefix"}) {
    for (const Workload& w : std::vector<Workload>(anchors)) {
      if (w.name != base) continue;
      Workload cap = w, sink = w;
      cap.name += "_cap";
      cap.soft_cap = 30.f;
      sink.name += "_sink";
      sink.sinks = true;
      anchors.push_back(cap);
      anchors.push_back(sink);
    }
  }
  anchors.push_back({"long32k", 1, 32768, 32768});
  Workload win = {"win4k_32k", 1, 32768, 32768};
  win.window_left = 4095;
  anchors.push_back(win);
  const size_t num_anchors = 4;  // the full run's table: the four anchors
  std::vector<Result> results;
  if (merge_only) {
    RunMerge(65536, reps * 2);
    RunMerge(512, reps * 5);
    return 0;
  }
  // The kernel to force, if any.
  PrefillKernel forced_kernel = PrefillKernel::kSm80;
  const PrefillKernel* forced = nullptr;
  if (only_kernel != "auto") {
    bool known = false;
    for (int k = 0; k < kNumPrefillKernels; ++k) {
      if (only_kernel == PrefillKernelName(static_cast<PrefillKernel>(k))) {
        forced_kernel = static_cast<PrefillKernel>(k);
        known = true;
      }
    }
    if (!known) {
      std::fprintf(stderr,
                   "--kernel=%s: expected auto, sm80, sm80_rows64, sm90, sm90_overlap, sm90_overlap_nopp or sm90_fp8q\n",
                   only_kernel.c_str());
      return 2;
    }
    if (IsSm90Kernel(forced_kernel) && prop.major != 9) {
      std::fprintf(stderr, "--kernel=%s: the sm90 family runs only on sm_90 devices; this one is sm_%d%d\n",
                   only_kernel.c_str(), prop.major, prop.minor);
      return 2;
    }
    forced = &forced_kernel;
  }
  // Sweep: 16k query tokens split into sequences of 512..16k.
  auto run_len_sweep = [&]() {
    for (int len = 512; len <= 16384; len *= 2) {
      RunPrefill({"sweep_len" + std::to_string(len), 16384 / len, len, len}, 1, forced, reps);
    }
  };
  if (!only_workload.empty()) {
    std::vector<const Workload*> picked;
    bool sweep = false;
    size_t start = 0;
    while (start <= only_workload.size()) {
      size_t end = only_workload.find(',', start);
      if (end == std::string::npos) end = only_workload.size();
      const std::string name = only_workload.substr(start, end - start);
      if (name == "sweep") {
        sweep = true;
        start = end + 1;
        continue;
      }
      // One point of the sweep (sweep_lenN), with --page_sizes and --trace.
      if (name.rfind("sweep_len", 0) == 0) {
        int len = 0;
        if (!BenchIntArg("--workload", name.c_str() + 9, 1, 16384, &len) || 16384 % len != 0) {
          std::fprintf(stderr, "--workload=%s: sweep_lenN takes N dividing 16384\n", name.c_str());
          return 2;
        }
        for (int ps : page_sizes) RunPrefill({name, 16384 / len, len, len}, ps, forced, reps, -1, trace_ctas);
        start = end + 1;
        continue;
      }
      const Workload* found = nullptr;
      for (const auto& w : anchors) {
        if (w.name == name) found = &w;
      }
      if (found == nullptr) {
        std::fprintf(stderr,
                     "--workload=%s: expected names among long, batch, prefix, decode, {long,batch,prefix}_cap, "
                     "{long,batch,prefix}_sink, long32k, win4k_32k, sweep, sweep_lenN\n",
                     only_workload.c_str());
        return 2;
      }
      picked.push_back(found);
      start = end + 1;
    }
    for (const Workload* w : picked) {
      for (int ps : page_sizes) RunPrefill(*w, ps, forced, reps, -1, trace_ctas);
    }
    if (sweep) run_len_sweep();
    return 0;
  }
  // The server's choice with the default plan first, then A/B of the plan's
  // L2 sections (0: plain longest-first order; 8 MiB).
  const std::vector<int> sections = {-1, 0, 8};
  for (int section_mb : sections) {
    for (int ps : {1, 16}) {
      for (size_t i = 0; i < num_anchors; ++i) results.push_back(RunPrefill(anchors[i], ps, forced, reps, section_mb));
    }
  }
  // The sequence-length sweep; decode batches.
  run_len_sweep();
  for (int b : {1, 8, 32, 128, 256}) {
    RunPrefill({"sweep_decode_b" + std::to_string(b), b, 1, 4096}, 1, forced, reps);
  }
  for (int b : {1, 4, 16}) {
    RunPrefill({"sweep_prefix_b" + std::to_string(b), b, 512, 4096}, 1, forced, reps);
  }
  RunMerge(65536, reps * 2);
  RunMerge(512, reps * 5);

  std::printf("\n%-8s %3s %-12s %4s %10s %10s %10s %7s %5s\n", "workload", "ps", "kernel", "L2MB", "ms", "TFLOP/s",
              "KV TB/s", "items", "split");
  for (const auto& r : results) {
    std::printf("%-8s %3d %-12s %4d %10.4f %10.1f %10.2f %7zu %5d\n", r.name.c_str(), r.page_size, r.kernel.c_str(),
                r.section_mb, r.ms, r.tflops, r.kv_tbs, r.items, r.split ? 1 : 0);
  }
  return 0;
}
