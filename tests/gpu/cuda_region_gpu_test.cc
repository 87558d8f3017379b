// CUDA IPC regions end to end (docs/transport.md): this test process
// allocates device memory on device 0, fills it with random values, exports
// it with cudaIpcGetMemHandle and registers it with a CUDA server running in
// another process: on device 1 when two GPUs are visible (every copy between
// them is then a peer copy), else on device 0. WriteKV, ReadKV, Prefill
// (decode rows and a prefill chunk, with fused appends) and MergeStates take
// every input from and write every output to the regions, and are checked
// against the float64 reference and against the same requests sent inline.
// Every bad reference gets its code and a message naming the field and the
// bound, and the server keeps serving; a region unregistered while in use and
// a client killed while holding regions leave the server serving and the
// regions reclaimable.
// Without a GPU every test reports "skipped: no GPU".
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/cuda_memory.h"
#include "client/workload.h"
#include "common/dtype.h"
#include "common/reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// cudaMalloc'ed memory on `device` of this process, exported by IPC handle
// (client/cuda_memory.h), filled with 0x5a.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, int64_t bytes) {
    auto memory = CudaMemory::Create(device, bytes, 0x5a);
    EXPECT_TRUE(memory.ok()) << memory.status();
    if (memory.ok()) memory_ = *std::move(memory);
  }
  void Put(int64_t offset, const void* src, int64_t bytes) {
    ASSERT_NE(memory_, nullptr);
    absl::Status s = memory_->CopyIn(offset, src, bytes);
    ASSERT_TRUE(s.ok()) << s;
  }
  template <typename T>
  std::vector<T> Get(int64_t offset, int64_t count) const {
    std::vector<T> out(count);
    absl::Status s = memory_ == nullptr ? absl::InternalError("no device memory")
                                        : memory_->CopyOut(offset, out.data(), count * sizeof(T));
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }
  std::string Handle() const { return memory_ == nullptr ? std::string() : memory_->ipc_handle(); }
  int device() const { return memory_ == nullptr ? -1 : memory_->device(); }
  int64_t size() const { return memory_ == nullptr ? 0 : memory_->size(); }

 private:
  std::unique_ptr<CudaMemory> memory_;
};

// The float64 merge of common/reference.h (base 2) over the client's states.
void ReferenceMerge(const std::vector<State>& states, int64_t rows, int32_t d, KvDType dtype,
                    std::vector<double>* v, std::vector<double>* lse) {
  std::vector<reference::State> ref;
  for (const State& s : states) ref.push_back({s.v.data(), s.lse.data()});
  reference::Merge(dtype, ref, rows, d, /*lse_base_e=*/false, v, lse);
}

// A CUDA server with tenants alice and bob and regions on.
class CudaRegionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    devices_ = DeviceCount();
    if (devices_ == 0) GTEST_SKIP() << "skipped: no GPU";
    server_device_ = devices_ >= 2 ? 1 : 0;
    auto tokens = WriteTokensFile("tok-alice alice\ntok-bob bob\n");
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    tokens_path_ = *tokens;
    TestServerOptions options;
    options.num_layers = 2;
    options.num_pages = 2048;
    options.page_size = 16;
    options.num_qo_heads = 8;
    options.num_kv_heads = 2;
    options.head_dim = 128;
    options.extra_flags = {"--backend=cuda", absl::StrCat("--device=", server_device_),
                           "--auth_tokens_file=" + tokens_path_, "--allow_shared_memory",
                           "--max_regions_per_tenant=8"};
    auto server = TestServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    alice_ = Connect("tok-alice");
    bob_ = Connect("tok-bob");
    ASSERT_TRUE(alice_ && bob_);
    geo_ = GeometryOf(alice_->info());
    ASSERT_EQ(alice_->info().backend(), "cuda");
    std::cout << "client on device 0, server on device " << server_device_ << " of " << devices_
              << "\n";
  }
  void TearDown() override {
    alice_.reset();
    bob_.reset();
    if (server_ != nullptr) {
      EXPECT_TRUE(server_->Alive()) << server_->Output();
      EXPECT_EQ(server_->Stop(), 0) << server_->Output();
    }
    if (!tokens_path_.empty()) unlink(tokens_path_.c_str());
  }

  std::unique_ptr<Client> Connect(const std::string& token) {
    ClientOptions options;
    options.target = server_->grpc_address();
    options.token = token;
    options.timeout_s = 120;
    auto client = Client::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  double Metric(const std::string& name, const std::string& labels) {
    auto body = HttpGet(server_->metrics_address(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    auto v = MetricValue(body.ok() ? *body : "", name, labels);
    return v.ok() ? *v : -1;
  }

  absl::Status Register(Client* as, const std::string& name, const DeviceBuffer& buf) {
    return as->RegisterCudaRegion(name, buf.Handle(), buf.device(), buf.size());
  }

  // One Prefill with q, the appended rows, the output and the LSE in region
  // "io" (q at q_at), checked against the reference and the inline request.
  void PrefillThroughRegion(KvMirror& mirror, const PrefillInputs& in, int32_t append_page,
                            DeviceBuffer& io, int64_t q_at, std::mt19937_64& gen) {
    const int64_t total_q = in.total_q();
    const int64_t q_bytes = total_q * geo_.num_qo_heads * geo_.head_dim * 2;
    const int64_t lse_bytes = total_q * geo_.num_qo_heads * 4;
    const int64_t row_bytes = geo_.RowElems() * 2;
    const std::vector<int64_t> append_slots = {int64_t{append_page} * geo_.page_size + 3,
                                               int64_t{append_page} * geo_.page_size + 4};
    const int64_t append_bytes = 2 * row_bytes;
    const auto ak = RandomHalves(gen, geo_.dtype, 2 * geo_.RowElems());
    const auto av = RandomHalves(gen, geo_.dtype, 2 * geo_.RowElems());
    const int64_t k_at = q_at + q_bytes, v_at = k_at + append_bytes;
    const int64_t o_at = (v_at + append_bytes + 4096) / 256 * 256, lse_at = o_at + q_bytes + 64;
    ASSERT_LE(lse_at + lse_bytes, io.size());
    io.Put(q_at, in.q.data(), q_bytes);
    io.Put(k_at, ak.data(), append_bytes);
    io.Put(v_at, av.data(), append_bytes);
    PrefillArgs args = ArgsOf(in);
    args.q = {};
    args.q_region = RegionRef{"io", q_at, q_bytes};
    args.q_rows = total_q;
    args.append_slots = append_slots;
    args.append_k_region = RegionRef{"io", k_at, append_bytes};
    args.append_v_region = RegionRef{"io", v_at, append_bytes};
    args.output_region = RegionRef{"io", o_at, q_bytes};
    args.lse_region = RegionRef{"io", lse_at, lse_bytes};
    auto got = alice_->Prefill(args);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->o.empty());
    EXPECT_TRUE(got->lse.empty());
    mirror.Write(in.layer, append_slots, ak, av);
    const auto o = io.Get<uint16_t>(o_at, q_bytes / 2);
    const auto lse = io.Get<float>(lse_at, lse_bytes / 4);
    std::vector<double> o_ref, lse_ref;
    ReferencePrefill(mirror, in, &o_ref, &lse_ref);
    const Comparison c = Compare(geo_.dtype, o_ref, lse_ref, o, lse);
    EXPECT_TRUE(c.Ok(geo_.dtype)) << c.ToString();
    // The bytes between output and LSE were not touched.
    const auto gap = io.Get<uint8_t>(o_at + q_bytes, 64);
    for (uint8_t b : gap) ASSERT_EQ(b, 0x5a);
    // The same request inline gives the same bytes.
    auto inline_result = alice_->Prefill(ArgsOf(in));
    ASSERT_TRUE(inline_result.ok()) << inline_result.status();
    EXPECT_EQ(inline_result->o, o);
    EXPECT_EQ(inline_result->lse, lse);
  }

  int devices_ = 0;
  int server_device_ = 0;
  std::string tokens_path_;
  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> alice_, bob_;
  KvGeometry geo_;
};

TEST_F(CudaRegionsTest, EveryTensorInCudaRegionsMatchesTheReference) {
  std::mt19937_64 gen(2024);
  KvMirror mirror(geo_);
  WorkloadSpec decode;
  decode.batch = 12;
  decode.max_q_len = 1;
  decode.max_kv_len = 700;
  WorkloadSpec chunk;
  chunk.batch = 3;
  chunk.max_q_len = 90;
  chunk.max_kv_len = 400;
  chunk.layer = 1;
  const int64_t need = PagesNeeded(geo_, decode) + PagesNeeded(geo_, chunk) + 2;
  auto pages = alice_->AllocatePages(static_cast<int32_t>(need));
  ASSERT_TRUE(pages.ok()) << pages.status();
  const int32_t append_page = pages->back();
  pages->pop_back();

  // K/V of every page in both layers, from region "kv".
  const std::vector<int64_t> slots = SlotsOfPages(geo_, *pages);
  const int64_t n = static_cast<int64_t>(slots.size()) * geo_.RowElems();
  DeviceBuffer kv(0, 4 * n * 2 + 4096);
  ASSERT_TRUE(Register(alice_.get(), "kv", kv).ok());
  for (int32_t layer = 0; layer < 2; ++layer) {
    const auto k = RandomHalves(gen, geo_.dtype, n), v = RandomHalves(gen, geo_.dtype, n);
    kv.Put(0, k.data(), n * 2);
    kv.Put(n * 2, v.data(), n * 2);
    ASSERT_TRUE(alice_->WriteKVFromRegions(layer, slots, RegionRef{"kv", 0, n * 2},
                                           RegionRef{"kv", n * 2, n * 2})
                    .ok());
    mirror.Write(layer, slots, k, v);
    // ReadKV into the region, behind what was written.
    ASSERT_TRUE(alice_->ReadKVToRegions(layer, slots, RegionRef{"kv", 2 * n * 2, n * 2},
                                        RegionRef{"kv", 3 * n * 2, n * 2})
                    .ok());
    EXPECT_EQ(kv.Get<uint16_t>(2 * n * 2, n), k);
    EXPECT_EQ(kv.Get<uint16_t>(3 * n * 2, n), v);
  }

  DeviceBuffer io(0, 8 << 20);
  ASSERT_TRUE(Register(alice_.get(), "io", io).ok());
  std::vector<int32_t> decode_pages(pages->begin(), pages->begin() + PagesNeeded(geo_, decode));
  std::vector<int32_t> chunk_pages(pages->begin() + PagesNeeded(geo_, decode), pages->end());
  PrefillInputs d = RandomPrefill(gen, geo_, decode, decode_pages);
  // q at offset 2: an element-aligned address no 16-byte load could use.
  ASSERT_NO_FATAL_FAILURE(PrefillThroughRegion(mirror, d, append_page, io, 2, gen));
  PrefillInputs c = RandomPrefill(gen, geo_, chunk, chunk_pages);
  ASSERT_NO_FATAL_FAILURE(PrefillThroughRegion(mirror, c, append_page, io, 0, gen));

  // MergeStates: three states and the output in region "io", at 16-byte
  // aligned offsets (merged on the GPU), then at 2-byte aligned ones (merged
  // through host memory); both against the reference.
  const int64_t mn = 5;
  const int32_t h = geo_.num_qo_heads, dd = geo_.head_dim;
  const int64_t v_bytes = mn * h * dd * 2, lse_bytes = mn * h * 4;
  std::vector<State> states(3);
  std::uniform_real_distribution<float> lse_dist(-20.f, 20.f);
  std::bernoulli_distribution neg_inf(0.2);
  for (State& s : states) {
    s.v = RandomHalves(gen, geo_.dtype, mn * h * dd);
    s.lse.resize(mn * h);
    for (float& l : s.lse) l = neg_inf(gen) ? -std::numeric_limits<float>::infinity() : lse_dist(gen);
  }
  std::vector<double> v_ref, lse_ref;
  ReferenceMerge(states, mn * h, dd, geo_.dtype, &v_ref, &lse_ref);
  auto inline_merge = alice_->MergeStates(states, mn, h, dd, false);
  ASSERT_TRUE(inline_merge.ok()) << inline_merge.status();
  for (int64_t shift : {int64_t{0}, int64_t{2}}) {
    v1::MergeStatesRequest req;
    const int64_t stride = (v_bytes + lse_bytes + 255) / 256 * 256;
    for (size_t i = 0; i < states.size(); ++i) {
      const int64_t at = static_cast<int64_t>(i) * stride + shift;
      io.Put(at, states[i].v.data(), v_bytes);
      io.Put(at + v_bytes + (4 - shift % 4) % 4, states[i].lse.data(), lse_bytes);
      v1::AttentionState* s = req.add_states();
      s->mutable_v()->set_dtype(v1::DTYPE_BF16);
      for (int64_t x : {mn, int64_t{h}, int64_t{dd}}) s->mutable_v()->add_shape(x);
      auto* vr = s->mutable_v()->mutable_region();
      vr->set_name("io");
      vr->set_offset(at);
      vr->set_byte_size(v_bytes);
      s->mutable_lse()->set_dtype(v1::DTYPE_FP32);
      for (int64_t x : {mn, int64_t{h}}) s->mutable_lse()->add_shape(x);
      auto* lr = s->mutable_lse()->mutable_region();
      lr->set_name("io");
      lr->set_offset(at + v_bytes + (4 - shift % 4) % 4);
      lr->set_byte_size(lse_bytes);
    }
    const int64_t out_at = 3 * stride + shift, out_lse_at = 4 * stride;
    req.mutable_v_region()->set_name("io");
    req.mutable_v_region()->set_offset(out_at);
    req.mutable_v_region()->set_byte_size(v_bytes);
    req.mutable_lse_region()->set_name("io");
    req.mutable_lse_region()->set_offset(out_lse_at);
    req.mutable_lse_region()->set_byte_size(lse_bytes);
    grpc::ClientContext ctx;
    alice_->PrepareContext(&ctx);
    v1::MergeStatesResponse resp;
    grpc::Status s = alice_->stub()->MergeStates(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_TRUE(resp.v().data().empty());
    const auto v = io.Get<uint16_t>(out_at, v_bytes / 2);
    const auto lse = io.Get<float>(out_lse_at, lse_bytes / 4);
    const Comparison cmp = Compare(geo_.dtype, v_ref, lse_ref, v, lse);
    EXPECT_TRUE(cmp.Ok(geo_.dtype)) << "shift " << shift << ": " << cmp.ToString();
  }

  EXPECT_GT(Metric("attnserve_transfer_bytes_total", "direction=\"in\",path=\"cuda\""), 2 * n * 2);
  EXPECT_GT(Metric("attnserve_transfer_bytes_total", "direction=\"out\",path=\"cuda\""), 2 * n * 2);
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 2);
  EXPECT_EQ(Metric("attnserve_tenant_region_bytes", "tenant=\"alice\""), kv.size() + io.size());
  auto listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].device_id(), 0);
  EXPECT_TRUE(alice_->UnregisterRegion("io").ok());
  EXPECT_TRUE(alice_->UnregisterRegion("kv").ok());
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 0);
}

TEST_F(CudaRegionsTest, BadReferencesNameTheFieldAndLeaveTheServerServing) {
  DeviceBuffer buf(0, 1 << 20);
  const std::string handle = buf.Handle();
  struct Case {
    std::string handle;
    int32_t device_id;
    int64_t byte_size;
    absl::StatusCode code;
    std::string text;
  };
  std::string garbage(64, '\0');
  std::mt19937_64 gen(5);
  for (char& ch : garbage) ch = static_cast<char>(gen());
  std::vector<Case> cases = {
      {garbage, 0, 4096, absl::StatusCode::kInvalidArgument, "cuda.ipc_handle does not open"},
      {handle.substr(0, 63), 0, 4096, absl::StatusCode::kInvalidArgument, "cuda.ipc_handle has 63"},
      {handle, devices_, 4096, absl::StatusCode::kInvalidArgument,
       absl::StrCat("cuda.device_id=", devices_, " out of range [0, ", devices_, ")")},
      {handle, 0, (1 << 20) + 4096 * 1024, absl::StatusCode::kInvalidArgument,
       "exceeds the allocation cuda.ipc_handle exports"},
  };
  for (const Case& c : cases) {
    absl::Status s = alice_->RegisterCudaRegion("g", c.handle, c.device_id, c.byte_size);
    EXPECT_EQ(s.code(), c.code) << c.text << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.text));
  }
  auto none = alice_->ListRegions();
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());

  ASSERT_TRUE(Register(alice_.get(), "g", buf).ok());
  // The same allocation under a second name (one mapping, counted twice).
  ASSERT_TRUE(alice_->RegisterCudaRegion("g2", handle, 0, 4096).ok());
  auto pages = alice_->AllocatePages(1);
  ASSERT_TRUE(pages.ok());
  const std::vector<int64_t> slots = {int64_t{(*pages)[0]} * geo_.page_size};
  const int64_t row = geo_.RowElems() * 2;
  absl::Status other = bob_->WriteKVFromRegions(0, slots, RegionRef{"g", 0, row}, RegionRef{"g", row, row});
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied) << other;  // bob's slots aside
  EXPECT_THAT(std::string(other.message()), HasSubstr("belongs to another tenant"));
  absl::Status unknown = alice_->WriteKVFromRegions(0, slots, RegionRef{"nope", 0, row},
                                                    RegionRef{"g", row, row});
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("k.region.name: region 'nope'"));
  absl::Status oob = alice_->WriteKVFromRegions(0, slots, RegionRef{"g2", 0, row},
                                                RegionRef{"g2", 4096 - row / 2, row});
  EXPECT_EQ(oob.code(), absl::StatusCode::kInvalidArgument) << oob;
  EXPECT_THAT(std::string(oob.message()), HasSubstr("exceeds the size of region 'g2' (4096 bytes)"));
  absl::Status unaligned = alice_->ReadKVToRegions(0, slots, RegionRef{"g", 1, row},
                                                   RegionRef{"g", 2 * row, row});
  EXPECT_EQ(unaligned.code(), absl::StatusCode::kInvalidArgument) << unaligned;
  EXPECT_THAT(std::string(unaligned.message()), HasSubstr("k_region.offset=1 misaligns"));
  EXPECT_EQ(bob_->UnregisterRegion("g").code(), absl::StatusCode::kPermissionDenied);

  // Still serving: a good write and read through the region.
  std::vector<uint16_t> k = RandomHalves(gen, geo_.dtype, geo_.RowElems());
  std::vector<uint16_t> v = RandomHalves(gen, geo_.dtype, geo_.RowElems());
  buf.Put(0, k.data(), row);
  buf.Put(row, v.data(), row);
  ASSERT_TRUE(alice_->WriteKVFromRegions(0, slots, RegionRef{"g", 0, row}, RegionRef{"g", row, row}).ok());
  auto back = alice_->ReadKV(0, slots);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->k, k);
  EXPECT_EQ(back->v, v);

  // Unregistered while requests use it: each request either ran before the
  // name went (and is correct) or got NOT_FOUND; the mapping stays for the
  // ones in flight, and the server keeps serving.
  std::atomic<int> ok{0}, not_found{0}, other_code{0};
  std::thread reader([&] {
    for (int i = 0; i < 200; ++i) {
      absl::Status s = alice_->ReadKVToRegions(0, slots, RegionRef{"g", 4 * row, row},
                                               RegionRef{"g", 5 * row, row});
      if (s.ok()) {
        ++ok;
      } else if (s.code() == absl::StatusCode::kNotFound) {
        ++not_found;
        break;
      } else {
        ++other_code;
      }
    }
  });
  std::this_thread::yield();
  EXPECT_TRUE(alice_->UnregisterRegion("g").ok());
  reader.join();
  EXPECT_EQ(other_code, 0);
  EXPECT_LE(not_found, 1);
  if (ok > 0) {
    EXPECT_EQ(buf.Get<uint16_t>(4 * row, geo_.RowElems()), k);
  }
  // "g2" (the same allocation) still works after "g" went.
  ASSERT_TRUE(alice_->ReadKVToRegions(0, slots, RegionRef{"g2", 6 * row, row},
                                      RegionRef{"g2", 7 * row, row}).ok());
  EXPECT_EQ(buf.Get<uint16_t>(7 * row, geo_.RowElems()), v);
  EXPECT_TRUE(alice_->UnregisterRegion("g2").ok());
  // And the handle opens again once both are gone.
  ASSERT_TRUE(Register(alice_.get(), "g", buf).ok());
  EXPECT_TRUE(alice_->UnregisterRegion("g").ok());
}

// A client process registers CUDA regions and is killed (SIGKILL) without
// unregistering: the server keeps serving, lists the regions, and they can
// be unregistered (their handles closed) by another connection of the same
// tenant.
TEST_F(CudaRegionsTest, AKilledClientsCudaRegionsCanBeUnregistered) {
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  // $CUDA_REGION_HOLDER_BIN overrides the path it was built with.
  const char* env = std::getenv("CUDA_REGION_HOLDER_BIN");
  const std::string holder = env != nullptr && *env != '\0' ? env : CUDA_REGION_HOLDER_BIN;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(pipe_fds[1], 1);
    close(pipe_fds[0]);
    execl(holder.c_str(), holder.c_str(), server_->grpc_address().c_str(),
          "tok-alice", "held", "4194304", "0", nullptr);
    _exit(127);
  }
  close(pipe_fds[1]);
  std::string got;
  char buf[64];
  ssize_t r;
  while (got.find('\n') == std::string::npos && (r = read(pipe_fds[0], buf, sizeof(buf))) > 0) {
    got.append(buf, r);
  }
  close(pipe_fds[0]);
  EXPECT_EQ(got, "ready\n");
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  auto listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].name(), "held0");
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 2);
  // Serving: an inline write and read.
  auto pages = alice_->AllocatePages(1);
  ASSERT_TRUE(pages.ok());
  const std::vector<int64_t> slots = {int64_t{(*pages)[0]} * geo_.page_size};
  std::mt19937_64 gen(9);
  const auto k = RandomHalves(gen, geo_.dtype, geo_.RowElems());
  ASSERT_TRUE(alice_->WriteKV(0, slots, k, k).ok());
  auto back = alice_->ReadKV(0, slots);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->k, k);
  EXPECT_TRUE(alice_->UnregisterRegion("held0").ok());
  EXPECT_TRUE(alice_->UnregisterRegion("held1").ok());
  listed = alice_->ListRegions();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
  EXPECT_EQ(Metric("attnserve_tenant_regions", "tenant=\"alice\""), 0);
  // New regions of a live process still work.
  DeviceBuffer fresh(0, 1 << 20);
  ASSERT_TRUE(Register(alice_.get(), "fresh", fresh).ok());
  fresh.Put(0, k.data(), geo_.RowElems() * 2);
  ASSERT_TRUE(alice_->WriteKVFromRegions(0, slots, RegionRef{"fresh", 0, geo_.RowElems() * 2},
                                         RegionRef{"fresh", 0, geo_.RowElems() * 2}).ok());
  EXPECT_TRUE(alice_->UnregisterRegion("fresh").ok());
}

}  // namespace
}  // namespace attnserve
