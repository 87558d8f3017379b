// The CUDA backend through the real server and client: the same random
// ragged batches go to a CUDA server and a CPU server of the same geometry,
// and both are compared with the float64 reference and with each other.
// Covers page_size 1/16/64, GQA groups 1/4/8, head_dim 64/128/256, bf16 and
// fp16, several layers in one batch (concurrent clients), a KV longer than
// 64k tokens that forces split-KV, and the metrics of batching (many
// requests per attention launch, at most one merge launch per batch).
// Decode-shaped requests (1..8 query rows per sequence) run on the decode
// kernel family: DecodeMatchesReferenceAndOffSwitch compares a server with
// --decode_kernel=auto and one with =off against the reference and checks
// the attention_decode launch series.
// Without a GPU every test reports "skipped: no GPU".
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <atomic>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/shared_memory.h"
#include "client/workload.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "server/backend/cuda/cuda_backend.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

struct Config {
  int32_t page_size, num_qo_heads, num_kv_heads, head_dim;
  const char* dtype;
};


std::unique_ptr<TestServer> StartServer(const Config& c, const std::string& backend,
                                        int32_t num_pages, const std::string& decode_kernel = "auto",
                                        std::vector<std::string> more_flags = {}) {
  TestServerOptions o;
  o.num_layers = 3;
  o.num_pages = num_pages;
  o.page_size = c.page_size;
  o.num_qo_heads = c.num_qo_heads;
  o.num_kv_heads = c.num_kv_heads;
  o.head_dim = c.head_dim;
  o.kv_dtype = c.dtype;
  o.extra_flags = {"--backend=" + backend, "--decode_kernel=" + decode_kernel};
  o.extra_flags.insert(o.extra_flags.end(), more_flags.begin(), more_flags.end());
  auto s = TestServer::Start(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

std::unique_ptr<Client> ConnectTo(const TestServer& server) {
  ClientOptions o;
  o.target = server.grpc_address();
  o.timeout_s = 120;
  auto c = Client::Connect(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}


// Writes random K/V into every slot of `pages` on each client (same data).
void FillPages(std::mt19937_64& gen, const KvGeometry& g, int32_t layer,
               const std::vector<int32_t>& pages, const std::vector<Client*>& clients,
               KvMirror* mirror) {
  std::vector<int64_t> slots = SlotsOfPages(g, pages);
  // Chunks keep each message small.
  const size_t chunk = 4096;
  for (size_t at = 0; at < slots.size(); at += chunk) {
    const size_t n = std::min(chunk, slots.size() - at);
    std::vector<int64_t> part(slots.begin() + at, slots.begin() + at + n);
    auto k = RandomHalves(gen, g.dtype, static_cast<int64_t>(n) * g.RowElems());
    auto v = RandomHalves(gen, g.dtype, static_cast<int64_t>(n) * g.RowElems());
    for (Client* c : clients) ASSERT_TRUE(c->WriteKV(layer, part, k, v).ok());
    mirror->Write(layer, part, k, v);
  }
}

double RelDiff(KvDType dtype, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = HalfToFloat(dtype, a[i]), y = HalfToFloat(dtype, b[i]);
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

class ServerGpuTest : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "skipped: no GPU";
  }
};

TEST_P(ServerGpuTest, CudaServerMatchesCpuServerAndReference) {
  const Config c = GetParam();
  auto cuda = StartServer(c, "cuda", 2048);
  auto cpu = StartServer(c, "cpu", 2048);
  ASSERT_TRUE(cuda && cpu);
  auto gc = ConnectTo(*cuda);
  auto cc = ConnectTo(*cpu);
  ASSERT_TRUE(gc && cc);
  EXPECT_EQ(gc->info().backend(), "cuda");
  EXPECT_EQ(cc->info().backend(), "cpu");
  const KvGeometry g = GeometryOf(gc->info());
  std::mt19937_64 gen(c.page_size * 1000 + c.head_dim + c.num_kv_heads);
  for (int round = 0; round < 16; ++round) {
    WorkloadSpec spec;
    spec.batch = 1 + round % 6;
    spec.max_q_len = round % 3 == 0 ? 96 : 32;  // q_len > kv_len happens: rows that see nothing
    spec.max_kv_len = round % 8 == 0 ? 600 : 160;
    spec.causal = round % 5 != 1;
    spec.lse_base_e = round % 3 == 2;
    spec.layer = round % g.num_layers;
    const int32_t need = static_cast<int32_t>(std::max<int64_t>(PagesNeeded(g, spec), 1));
    auto gp = gc->AllocatePages(need);
    auto cp = cc->AllocatePages(need);
    ASSERT_TRUE(gp.ok() && cp.ok());
    ASSERT_EQ(*gp, *cp) << "fresh servers hand out the same page ids";
    KvMirror mirror(g);
    FillPages(gen, g, spec.layer, *gp, {gc.get(), cc.get()}, &mirror);
    PrefillInputs in = RandomPrefill(gen, g, spec, *gp);
    if (round % 4 == 3) {
      // Page ids repeated across sequences (a shared prefix).
      for (size_t i = 1; i < in.kv_indices.size(); i += 3) in.kv_indices[i] = in.kv_indices[0];
    }
    if (round % 7 == 6) in.sm_scale = 0.05f;
    auto go = gc->Prefill(ArgsOf(in));
    auto co = cc->Prefill(ArgsOf(in));
    ASSERT_TRUE(go.ok()) << go.status();
    ASSERT_TRUE(co.ok()) << co.status();
    std::vector<double> o_ref, lse_ref;
    ReferencePrefill(mirror, in, &o_ref, &lse_ref);
    Comparison gcmp = Compare(g.dtype, o_ref, lse_ref, go->o, go->lse);
    Comparison ccmp = Compare(g.dtype, o_ref, lse_ref, co->o, co->lse);
    EXPECT_TRUE(gcmp.Ok(g.dtype)) << "cuda round " << round << ": " << gcmp.ToString();
    EXPECT_TRUE(ccmp.Ok(g.dtype)) << "cpu round " << round << ": " << ccmp.ToString();
    EXPECT_LT(RelDiff(g.dtype, go->o, co->o), 1e-2) << "cuda vs cpu, round " << round;
    ASSERT_TRUE(gc->FreePages(*gp).ok());
    ASSERT_TRUE(cc->FreePages(*cp).ok());
  }
}

// Decode and speculative decode (1..8 rows per sequence, some sequences
// empty) over short and long KV (long ones split), the same inputs on a CUDA
// server with the decode family and one with --decode_kernel=off; both
// against the reference; only the first counts attention_decode launches.
TEST_P(ServerGpuTest, DecodeMatchesReferenceAndOffSwitch) {
  const Config c = GetParam();
  // Up to 5 sequences of up to 6000 tokens per round.
  const int32_t pages = 5 * 6000 / c.page_size + 64;
  auto on = StartServer(c, "cuda", pages, "auto");
  auto off = StartServer(c, "cuda", pages, "off");
  ASSERT_TRUE(on && off);
  auto gon = ConnectTo(*on);
  auto goff = ConnectTo(*off);
  ASSERT_TRUE(gon && goff);
  const KvGeometry g = GeometryOf(gon->info());
  const std::string on_before = *HttpGet(on->metrics_address(), "/metrics");
  const std::string off_before = *HttpGet(off->metrics_address(), "/metrics");
  std::mt19937_64 gen(c.page_size * 7 + c.head_dim + c.num_qo_heads);
  for (int round = 0; round < 10; ++round) {
    WorkloadSpec spec;
    spec.batch = 1 + round % 5;
    spec.max_q_len = round % 2 ? 1 : 8;
    spec.max_kv_len = round % 3 == 0 ? 6000 : 300;
    spec.causal = round % 4 != 1;
    spec.lse_base_e = round % 3 == 2;
    spec.layer = round % g.num_layers;
    const int32_t need = static_cast<int32_t>(std::max<int64_t>(PagesNeeded(g, spec), 1));
    auto p_on = gon->AllocatePages(need);
    auto p_off = goff->AllocatePages(need);
    ASSERT_TRUE(p_on.ok() && p_off.ok());
    ASSERT_EQ(*p_on, *p_off) << "fresh servers hand out the same page ids";
    KvMirror mirror(g);
    FillPages(gen, g, spec.layer, *p_on, {gon.get(), goff.get()}, &mirror);
    const PrefillInputs in = RandomPrefill(gen, g, spec, *p_on);
    auto o_on = gon->Prefill(ArgsOf(in));
    auto o_off = goff->Prefill(ArgsOf(in));
    ASSERT_TRUE(o_on.ok()) << o_on.status();
    ASSERT_TRUE(o_off.ok()) << o_off.status();
    std::vector<double> o_ref, lse_ref;
    ReferencePrefill(mirror, in, &o_ref, &lse_ref);
    Comparison c_on = Compare(g.dtype, o_ref, lse_ref, o_on->o, o_on->lse);
    Comparison c_off = Compare(g.dtype, o_ref, lse_ref, o_off->o, o_off->lse);
    EXPECT_TRUE(c_on.Ok(g.dtype)) << "decode_kernel=auto round " << round << ": " << c_on.ToString();
    EXPECT_TRUE(c_off.Ok(g.dtype)) << "decode_kernel=off round " << round << ": " << c_off.ToString();
    ASSERT_TRUE(gon->FreePages(*p_on).ok());
    ASSERT_TRUE(goff->FreePages(*p_off).ok());
  }
  auto delta = [](const TestServer& s, const std::string& before, const std::string& kernel) {
    const std::string now = *HttpGet(s.metrics_address(), "/metrics");
    const std::string label = "kernel=\"" + kernel + "\"";
    auto a = MetricValue(now, "attnserve_kernel_launches_total", label);
    auto b = MetricValue(before, "attnserve_kernel_launches_total", label);
    EXPECT_TRUE(a.ok() && b.ok()) << kernel << ": " << a.status() << " " << b.status();
    return a.ok() && b.ok() ? *a - *b : -1.0;
  };
  EXPECT_GT(delta(*on, on_before, "attention_decode"), 0) << "decode requests ran on the decode family";
  EXPECT_EQ(delta(*on, on_before, "attention_prefill"), 0) << "decode-only requests need no prefill launch";
  EXPECT_EQ(delta(*off, off_before, "attention_decode"), 0) << "--decode_kernel=off";
  EXPECT_GT(delta(*off, off_before, "attention_prefill"), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, ServerGpuTest,
    ::testing::Values(Config{1, 32, 4, 128, "bf16"}, Config{16, 32, 4, 128, "bf16"},
                      Config{64, 16, 16, 64, "fp16"}, Config{16, 16, 2, 64, "bf16"},
                      Config{1, 8, 1, 256, "bf16"}, Config{16, 8, 2, 256, "fp16"}),
    [](const ::testing::TestParamInfo<Config>& info) {
      const Config& c = info.param;
      return absl::StrCat("ps", c.page_size, "_h", c.num_qo_heads, "x", c.num_kv_heads, "_d",
                          c.head_dim, "_", c.dtype);
    });

// Tensors in a system shared-memory region on the CUDA backend: the server
// registers the region with the device, so a query or appended rows of at
// least 64 KiB are copied by the device straight from it and smaller ones go
// through the staging; outputs are written into the region. Each round runs
// the same request inline and through the region (append rows land on the
// same slots both times, the same bytes) and checks both against the float64
// reference and each other, byte for byte. The region's output bytes are
// poisoned before each round.
TEST(ServerGpuRegions, SystemRegionInputsAndOutputsMatchInline) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "skipped: no GPU";
  const Config c{16, 32, 4, 128, "bf16"};  // q row 8 KiB, K/V row 1 KiB
  auto server = StartServer(c, "cuda", 4096, "auto", {"--allow_shared_memory"});
  ASSERT_NE(server, nullptr);
  auto client = ConnectTo(*server);
  ASSERT_NE(client, nullptr);
  const KvGeometry g = GeometryOf(client->info());
  auto shm = SharedMemory::Create("attnserve-gpu-test", int64_t{8} << 20);
  ASSERT_TRUE(shm.ok()) << shm.status();
  ASSERT_TRUE(client->RegisterSystemRegion("io", **shm, 0, (*shm)->size()).ok());
  std::mt19937_64 gen(31);
  const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim * 2, kv_row = g.RowElems() * 2;
  // (sequences, max q_len, appended rows): small and large queries and appends.
  const int shapes[][3] = {{4, 1, 0}, {64, 1, 0}, {2, 40, 8}, {3, 96, 100}, {1, 300, 200}, {16, 8, 70}};
  for (int round = 0; round < 6; ++round) {
    WorkloadSpec spec;
    spec.batch = shapes[round][0];
    spec.max_q_len = shapes[round][1];
    spec.max_kv_len = 700;
    spec.layer = round % g.num_layers;
    const int64_t n_append = shapes[round][2];
    const int32_t need = static_cast<int32_t>(PagesNeeded(g, spec));
    const int32_t append_pages = static_cast<int32_t>((n_append + g.page_size - 1) / g.page_size);
    auto pages = client->AllocatePages(need + append_pages);
    ASSERT_TRUE(pages.ok()) << pages.status();
    const std::vector<int32_t> kv_pages(pages->begin(), pages->begin() + need);
    KvMirror mirror(g);
    FillPages(gen, g, spec.layer, kv_pages, {client.get()}, &mirror);
    PrefillInputs in = RandomPrefill(gen, g, spec, kv_pages);
    while (in.total_q() == 0) in = RandomPrefill(gen, g, spec, kv_pages);
    const int64_t total_q = in.total_q();
    // Appended rows go to pages no sequence reads: both runs write the same
    // bytes there, so the second sees what the first saw.
    std::vector<int64_t> slots;
    for (int64_t i = 0; i < n_append; ++i) {
      slots.push_back(int64_t{(*pages)[need + i / g.page_size]} * g.page_size + i % g.page_size);
    }
    const std::vector<uint16_t> ak = RandomHalves(gen, g.dtype, n_append * g.RowElems());
    const std::vector<uint16_t> av = RandomHalves(gen, g.dtype, n_append * g.RowElems());
    PrefillArgs inline_args = ArgsOf(in);
    inline_args.append_slots = slots;
    inline_args.append_k = ak;
    inline_args.append_v = av;
    auto inline_out = client->Prefill(inline_args);
    ASSERT_TRUE(inline_out.ok()) << inline_out.status();

    const int64_t q_bytes = total_q * q_row, a_bytes = n_append * kv_row;
    const int64_t lse_bytes = total_q * g.num_qo_heads * 4;
    const int64_t k_at = (q_bytes + 255) / 256 * 256, v_at = k_at + (a_bytes + 255) / 256 * 256;
    const int64_t o_at = v_at + (a_bytes + 255) / 256 * 256, lse_at = o_at + (q_bytes + 255) / 256 * 256;
    ASSERT_LE(lse_at + lse_bytes, (*shm)->size());
    char* base = (*shm)->data();
    std::memcpy(base, in.q.data(), q_bytes);
    std::memcpy(base + k_at, ak.data(), a_bytes);
    std::memcpy(base + v_at, av.data(), a_bytes);
    std::memset(base + o_at, 0xff, lse_at + lse_bytes - o_at);  // poison: NaNs
    PrefillArgs args = ArgsOf(in);
    args.q = {};
    args.q_region = RegionRef{"io", 0, q_bytes};
    args.q_rows = total_q;
    if (n_append > 0) {
      args.append_slots = slots;
      args.append_k_region = RegionRef{"io", k_at, a_bytes};
      args.append_v_region = RegionRef{"io", v_at, a_bytes};
    }
    args.output_region = RegionRef{"io", o_at, q_bytes};
    args.lse_region = RegionRef{"io", lse_at, lse_bytes};
    auto region_out = client->Prefill(args);
    ASSERT_TRUE(region_out.ok()) << "round " << round << ": " << region_out.status();
    std::vector<uint16_t> o(total_q * g.num_qo_heads * g.head_dim);
    std::vector<float> lse(total_q * g.num_qo_heads);
    std::memcpy(o.data(), base + o_at, q_bytes);
    std::memcpy(lse.data(), base + lse_at, lse_bytes);

    mirror.Write(spec.layer, slots, ak, av);
    std::vector<double> o_ref, lse_ref;
    ReferencePrefill(mirror, in, &o_ref, &lse_ref);
    const Comparison ci = Compare(g.dtype, o_ref, lse_ref, inline_out->o, inline_out->lse);
    const Comparison cr = Compare(g.dtype, o_ref, lse_ref, o, lse);
    EXPECT_TRUE(ci.Ok(g.dtype)) << "inline, round " << round << ": " << ci.ToString();
    EXPECT_TRUE(cr.Ok(g.dtype)) << "region, round " << round << ": " << cr.ToString();
    EXPECT_EQ(o, inline_out->o) << "round " << round;
    EXPECT_EQ(std::memcmp(lse.data(), inline_out->lse.data(), lse_bytes), 0) << "round " << round;
    // The appended rows are in the cache, as sent through the region.
    auto kv = client->ReadKV(spec.layer, slots);
    ASSERT_TRUE(kv.ok()) << kv.status();
    EXPECT_EQ(kv->k, ak) << "round " << round;
    EXPECT_EQ(kv->v, av) << "round " << round;
    ASSERT_TRUE(client->FreePages(*pages).ok());
  }
  ASSERT_TRUE(client->UnregisterRegion("io").ok());
}

// Concurrent clients over three layers: batched into few launches, each
// verified; a 70,000-token KV forces split-KV; at most one merge per batch.
TEST(ServerGpuBatching, ConcurrentLayersAndLongKvSplit) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "skipped: no GPU";
  const Config c{16, 16, 2, 128, "bf16"};
  auto server = StartServer(c, "cuda", 40000);  // 96 requests of up to 5 x 64 pages
  ASSERT_NE(server, nullptr);
  auto setup = ConnectTo(*server);
  ASSERT_NE(setup, nullptr);
  const KvGeometry g = GeometryOf(setup->info());

  // Long KV: one sequence of 16 rows over 70,000 tokens.
  {
    std::mt19937_64 gen(11);
    const int32_t kv_len = 70000;
    const int32_t pages_needed = (kv_len + g.page_size - 1) / g.page_size;
    auto pages = setup->AllocatePages(pages_needed);
    ASSERT_TRUE(pages.ok()) << pages.status();
    KvMirror mirror(g);
    FillPages(gen, g, 1, *pages, {setup.get()}, &mirror);
    PrefillInputs in;
    in.layer = 1;
    in.qo_indptr = {0, 16};
    in.kv_indptr = {0, pages_needed};
    in.kv_indices = *pages;
    std::shuffle(in.kv_indices.begin(), in.kv_indices.end(), gen);
    in.kv_last_page_len = {kv_len - (pages_needed - 1) * g.page_size};
    in.q = RandomHalves(gen, g.dtype, 16 * g.num_qo_heads * g.head_dim);
    const std::string before = *HttpGet(server->metrics_address(), "/metrics");
    auto out = setup->Prefill(ArgsOf(in));
    ASSERT_TRUE(out.ok()) << out.status();
    std::vector<double> o_ref, lse_ref;
    ReferencePrefill(mirror, in, &o_ref, &lse_ref);
    Comparison cmp = Compare(g.dtype, o_ref, lse_ref, out->o, out->lse);
    EXPECT_TRUE(cmp.Ok(g.dtype)) << cmp.ToString();
    const std::string after = *HttpGet(server->metrics_address(), "/metrics");
    const double merges = *MetricValue(after, "attnserve_kernel_launches_total", "kernel=\"merge\"") -
                          *MetricValue(before, "attnserve_kernel_launches_total", "kernel=\"merge\"");
    EXPECT_EQ(merges, 1) << "a 70k-token KV is split and merged in one launch";

    // The same KV with 4 rows: the decode family splits it and merges inside
    // its one launch (no merge launch).
    PrefillInputs dec = in;
    dec.qo_indptr = {0, 4};
    dec.q = RandomHalves(gen, g.dtype, 4 * g.num_qo_heads * g.head_dim);
    auto dout = setup->Prefill(ArgsOf(dec));
    ASSERT_TRUE(dout.ok()) << dout.status();
    ReferencePrefill(mirror, dec, &o_ref, &lse_ref);
    Comparison dcmp = Compare(g.dtype, o_ref, lse_ref, dout->o, dout->lse);
    EXPECT_TRUE(dcmp.Ok(g.dtype)) << "decode: " << dcmp.ToString();
    const std::string last = *HttpGet(server->metrics_address(), "/metrics");
    EXPECT_EQ(*MetricValue(last, "attnserve_kernel_launches_total", "kernel=\"merge\"") -
                  *MetricValue(after, "attnserve_kernel_launches_total", "kernel=\"merge\""),
              0);
    EXPECT_EQ(*MetricValue(last, "attnserve_kernel_launches_total", "kernel=\"attention_decode\"") -
                  *MetricValue(after, "attnserve_kernel_launches_total", "kernel=\"attention_decode\""),
              1);
    ASSERT_TRUE(setup->FreePages(*pages).ok());
  }

  // 12 clients x 8 requests over three layers. Inputs are prepared first and
  // the requests sent back to back from all clients at once, so that they
  // meet in the queue; each result is verified afterwards.
  constexpr int kClients = 12, kRequests = 8;
  struct Prepared {
    KvMirror mirror;
    PrefillInputs in;
    std::vector<int32_t> pages;
    absl::StatusOr<PrefillResult> out = absl::UnknownError("not sent");
  };
  std::vector<std::unique_ptr<Client>> clients(kClients);
  std::vector<std::vector<std::unique_ptr<Prepared>>> work(kClients);
  for (int t = 0; t < kClients; ++t) {
    clients[t] = ConnectTo(*server);
    ASSERT_NE(clients[t], nullptr);
    std::mt19937_64 gen(100 + t);
    for (int r = 0; r < kRequests; ++r) {
      WorkloadSpec spec;
      spec.batch = 2 + (t + r) % 4;
      spec.max_q_len = r % 2 ? 1 : 256;  // decode-like and prefill-like
      spec.max_kv_len = 1024;
      spec.layer = (t + r) % g.num_layers;
      auto pages = clients[t]->AllocatePages(static_cast<int32_t>(PagesNeeded(g, spec)));
      ASSERT_TRUE(pages.ok()) << pages.status();
      auto p = std::make_unique<Prepared>(Prepared{KvMirror(g), {}, *pages});
      FillPages(gen, g, spec.layer, p->pages, {clients[t].get()}, &p->mirror);
      p->in = RandomPrefill(gen, g, spec, p->pages);
      work[t].push_back(std::move(p));
    }
  }
  const std::string before = *HttpGet(server->metrics_address(), "/metrics");
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      ++ready;
      while (ready.load() < kClients) std::this_thread::yield();
      for (auto& p : work[t]) p->out = clients[t]->Prefill(ArgsOf(p->in));
    });
  }
  for (auto& th : threads) th.join();
  // The float64 reference is slow (minutes on one core): one verifying
  // thread per client, failures reported from this thread.
  std::vector<std::vector<std::string>> failures(kClients);
  threads.clear();
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      for (auto& p : work[t]) {
        if (!p->out.ok()) {
          failures[t].push_back(p->out.status().ToString());
          continue;
        }
        std::vector<double> o_ref, lse_ref;
        ReferencePrefill(p->mirror, p->in, &o_ref, &lse_ref);
        Comparison cmp = Compare(g.dtype, o_ref, lse_ref, p->out->o, p->out->lse);
        if (!cmp.Ok(g.dtype)) failures[t].push_back(cmp.ToString());
      }
    });
  }
  for (auto& th : threads) th.join();
  int bad = 0;
  for (int t = 0; t < kClients; ++t) {
    for (const std::string& f : failures[t]) {
      ADD_FAILURE() << "client " << t << ": " << f;
      ++bad;
    }
    for (auto& p : work[t]) (void)clients[t]->FreePages(p->pages);
  }
  EXPECT_EQ(bad, 0);
  const std::string m = *HttpGet(server->metrics_address(), "/metrics");
  auto delta = [&](const std::string& name, const std::string& labels) {
    return *MetricValue(m, name, labels) - *MetricValue(before, name, labels);
  };
  const double decode_launches = delta("attnserve_kernel_launches_total", "kernel=\"attention_decode\"");
  const double launches =
      delta("attnserve_kernel_launches_total", "kernel=\"attention_prefill\"") + decode_launches;
  const double merges = delta("attnserve_kernel_launches_total", "kernel=\"merge\"");
  const double batches = delta("attnserve_batch_requests_count", "");
  const double requests = delta("attnserve_batch_requests_sum", "");
  std::cout << "concurrent phase: requests=" << requests << " batches=" << batches
            << " attention launches=" << launches << " (decode family " << decode_launches
            << ") merge launches=" << merges << "\n";
  EXPECT_EQ(requests, kClients * kRequests);
  // At most one launch per family and batch; a batch whose sequences are all
  // empty needs none, hence <=.
  EXPECT_GT(decode_launches, 0) << "decode-like requests ran on the decode family";
  EXPECT_LE(decode_launches, batches) << "at most one decode launch per batch";
  EXPECT_LE(launches - decode_launches, batches) << "at most one prefill launch per batch";
  EXPECT_LE(merges, batches) << "at most one merge launch per batch";
  EXPECT_LT(batches, requests) << "concurrent requests share launches";
}

}  // namespace
}  // namespace attnserve
