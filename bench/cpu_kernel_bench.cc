// attnserve_cpu_kernel_bench: times the CPU backend's attention kernel
// (PagedPrefillCpu, kernels/cpu/paged_prefill_cpu.cc) on decodes, a prefill
// and MLA decodes of random bf16 (and one decode of fp16) data, each repeated for 2 s; prints the
// mean time per call and a checksum of the output. Threads: OMP_NUM_THREADS.
//
//   OMP_NUM_THREADS=1 build/bin/attnserve_cpu_kernel_bench
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>
#include "common/dtype.h"
#include "kernels/paged_prefill.h"
using namespace attnserve;
struct Shape { const char* name; int qo, kv, d, lora, rope, batch, q_len, kv_len; bool causal; bool fp16 = false; };
int main() {
  Shape shapes[] = {
    {"decode 64x4096 32/4x128", 32, 4, 128, 0, 0, 64, 1, 4096, true},
    {"decode 64x4096 32/4x128 fp16", 32, 4, 128, 0, 0, 64, 1, 4096, true, true},
    {"decode 2x4096 32/4x128", 32, 4, 128, 0, 0, 2, 1, 4096, true},
    {"decode 64x16 32/4x128", 32, 4, 128, 0, 0, 64, 1, 16, true},
    {"prefill 2x512 over 1024 32/4x128", 32, 4, 128, 0, 0, 2, 512, 1024, true},
    {"mla decode 16 heads 8x4096", 16, 1, 576, 512, 64, 8, 1, 4096, true},
    {"mla decode 128 heads 1x16384", 128, 1, 576, 512, 64, 1, 1, 16384, true},
  };
  std::mt19937 gen(1);
  for (const Shape& sh : shapes) {
    KvGeometry g;
    g.num_layers = 1; g.page_size = 16; g.num_qo_heads = sh.qo; g.num_kv_heads = sh.kv; g.head_dim = sh.d;
    const KvDType dt = sh.fp16 ? KvDType::kFp16 : KvDType::kBf16;
    g.dtype = dt;
    if (sh.lora) { g.attention = AttentionKind::kMla; g.kv_lora_rank = sh.lora; g.qk_rope_head_dim = sh.rope; }
    const int pages_per = (sh.kv_len + 15) / 16;
    g.num_pages = pages_per * sh.batch;
    std::vector<uint16_t> kc(g.num_pages * 16 * g.RowElems()), vc(kc.size());
    std::uniform_real_distribution<float> u(-1, 1);
    for (auto& x : kc) x = FloatToHalf(dt, u(gen));
    for (auto& x : vc) x = FloatToHalf(dt, u(gen));
    std::vector<uint16_t> q(int64_t(sh.batch) * sh.q_len * g.QRowElems());
    for (auto& x : q) x = FloatToHalf(dt, u(gen));
    std::vector<uint16_t> o(int64_t(sh.batch) * sh.q_len * g.ORowElems());
    std::vector<float> lse(int64_t(sh.batch) * sh.q_len * sh.qo);
    std::vector<int32_t> idx(g.num_pages);
    for (int i = 0; i < g.num_pages; ++i) idx[i] = i;
    std::vector<PrefillSeq> seqs(sh.batch);
    for (int b = 0; b < sh.batch; ++b) {
      seqs[b].q_start = b * sh.q_len; seqs[b].q_len = sh.q_len; seqs[b].kv_start = b * pages_per;
      seqs[b].kv_len = sh.kv_len; seqs[b].causal = sh.causal; seqs[b].sm_scale = 0.08f;
    }
    PagedPrefillParams p;
    p.q = q.data(); p.o = o.data(); p.lse = lse.data(); p.k_cache = kc.data();
    p.v_cache = sh.lora ? kc.data() : vc.data(); p.kv_indices = idx.data(); p.seqs = seqs.data();
    p.num_seqs = sh.batch; p.total_q = sh.batch * sh.q_len; p.geo = g;
    PagedPrefillCpu(p);
    const auto t0 = std::chrono::steady_clock::now();
    int iters = 0;
    double s = 0;
    do { PagedPrefillCpu(p); ++iters; s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); } while (s < 2.0);
    double sum = 0; for (auto x : o) sum += HalfToFloat(dt, x);
    std::printf("%-36s %9.2f ms  (checksum %.4f lse0 %.4f)\n", sh.name, s / iters * 1e3, sum, lse[0]);
  }
}
