// attnbench's clients (client/bench_worker.h).
#include "client/bench_worker.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace attnserve {
namespace {

constexpr int kVariants = 2;  // requests per shape and client: same pages, other q

// Sequences of (q_len, kv_len) each over consecutive pages taken from `pages`
// starting at *next.
BenchShape MakeShape(std::mt19937_64& gen, const KvGeometry& g, const std::string& name, int32_t batch,
                     int32_t q_len, int32_t kv_len, int32_t layer, const AttentionOptions& options,
                     const std::vector<int32_t>& pages, size_t* next) {
  BenchShape s;
  s.name = name;
  PrefillInputs& in = s.in;
  in.layer = layer;
  in.causal = true;
  in.options = options;
  const int64_t window = options.window_left.value_or(-1);
  in.qo_indptr.push_back(0);
  in.kv_indptr.push_back(0);
  const int32_t num_pages = (kv_len + g.page_size - 1) / g.page_size;
  int64_t visible = 0;
  for (int32_t b = 0; b < batch; ++b) {
    for (int32_t p = 0; p < num_pages; ++p) in.kv_indices.push_back(pages[(*next)++]);
    in.qo_indptr.push_back(in.qo_indptr.back() + q_len);
    in.kv_indptr.push_back(in.kv_indptr.back() + num_pages);
    in.kv_last_page_len.push_back(num_pages == 0 ? 0 : kv_len - (num_pages - 1) * g.page_size);
    // Row i at position p = i + kv_len - q_len sees keys [p - window, p].
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t p = i + kv_len - q_len;
      const int64_t end = std::max<int64_t>(0, std::min<int64_t>(kv_len, p + 1));
      const int64_t begin = window >= 0 ? std::max<int64_t>(0, p - window) : 0;
      visible += std::max<int64_t>(0, end - begin);
    }
  }
  in.q = RandomHalves(gen, g.dtype, in.total_q() * g.num_qo_heads * g.head_dim);
  s.rows = in.total_q();
  // 2 x (QK width + PV width) per visible (query, key) pair and head: 4 x
  // head_dim for GQA, 2 x (576 + 512) for DeepSeek's MLA.
  s.flops = 2.0 * (g.head_dim + g.VDim()) * g.num_qo_heads * static_cast<double>(visible);
  return s;
}

}  // namespace

int64_t PagesPerClient(const std::vector<ShapeSpec>& specs, int32_t batch, int32_t page_size) {
  int64_t pages = 0;
  for (const ShapeSpec& s : specs) pages += int64_t{batch} * ((int64_t{s.kv_len} + page_size - 1) / page_size);
  return pages;
}

std::string ShapeText(const BenchConfig& config) {
  const std::string& workload = config.workload;
  const int32_t batch = config.batch;
  const int32_t q = config.q_len, kv = config.kv_len;
  if (workload == "decode") {
    return absl::StrFormat("batch=%d kv_len=%d (one query row per sequence)", batch, kv);
  }
  if (workload == "prefill") return absl::StrFormat("batch=%d q_len=%d (keys = queries)", batch, q);
  return absl::StrFormat("batch=%d q_len=%d kv_len=%d", batch, q, kv);
}

std::vector<ShapeSpec> ShapesOf(const std::string& workload, int32_t q, int32_t kv) {
  const ShapeSpec decode{"decode", 1, kv}, prefill{"prefill", q, q}, prefix{"prefix", q, kv};
  if (workload == "decode") return {decode};
  if (workload == "prefill") return {prefill};
  if (workload == "prefix") return {prefix};
  if (workload == "mixed") return {decode, prefill, prefix};
  return {};
}

absl::Status BenchWorker::SetUp(const ClientOptions& options, const std::vector<ShapeSpec>& specs,
                                const BenchConfig& config, uint64_t seed, int index) {
  config_ = config;
  auto client = Client::Connect(options);
  if (!client.ok()) return client.status();
  client_ = *std::move(client);
  auto lease = LeaseKeeper::Start(client_.get());
  if (!lease.ok()) return lease.status();
  lease_ = *std::move(lease);
  geo_ = GeometryOf(client_->info());
  const KvGeometry& g = geo_;
  const int32_t batch = config.batch;
  const int64_t need = PagesPerClient(specs, batch, g.page_size);
  auto pages = client_->AllocatePages(static_cast<int32_t>(std::max<int64_t>(need, 1)));
  if (!pages.ok()) return pages.status();
  pages_ = *std::move(pages);
  std::mt19937_64 gen(seed);
  std::shuffle(pages_.begin(), pages_.end(), gen);
  mirror_ = std::make_unique<KvMirror>(g);
  const int32_t layer = config.layer;
  if (g.KvIsFp8() && config.kv_scale > 0) {
    const float scale = static_cast<float>(config.kv_scale);
    absl::Status s = client_->SetKvScales({LayerKvScales{layer, {scale}, {scale}}});
    if (!s.ok()) return s;
  }
  // The server's scales: the mirror quantizes (--fp8_rows: the rows sent)
  // and dequantizes with them.
  if (absl::Status s = MirrorServerScales(*client_, mirror_.get()); !s.ok()) return s;
  const bool fp8_rows = g.KvIsFp8() && config.fp8_rows;
  const std::vector<int64_t> slots = SlotsOfPages(g, pages_);
  // Written in pieces so that no WriteKV approaches the message limit.
  const size_t chunk = std::max<int64_t>(1, (16ll << 20) / (g.NumPools() * g.RowElems()));
  for (size_t at = 0; at < slots.size(); at += chunk) {
    const size_t n = std::min(chunk, slots.size() - at);
    absl::Span<const int64_t> part = absl::MakeConstSpan(slots).subspan(at, n);
    auto k = RandomHalves(gen, g.dtype, static_cast<int64_t>(n) * g.RowElems());
    // MLA: the latent rows in k alone.
    auto v = RandomHalves(gen, g.dtype, g.HasVPool() ? static_cast<int64_t>(n) * g.RowElems() : 0);
    if (fp8_rows) {
      // Quantized here as the server would (the mirror's copy is exactly
      // that), and sent as stored.
      mirror_->Write(layer, part, k, v);
      std::vector<uint8_t> k8(n * g.RowElems()), v8(k8.size());
      for (size_t i = 0; i < n; ++i) {
        std::memcpy(k8.data() + i * g.RowElems(), mirror_->StoredK(layer, part[i]), g.RowElems());
        std::memcpy(v8.data() + i * g.RowElems(), mirror_->StoredV(layer, part[i]), g.RowElems());
      }
      absl::Status s = client_->WriteKVFp8(layer, part, k8, v8);
      if (!s.ok()) return s;
      continue;
    }
    absl::Status s = client_->WriteKV(layer, part, k, v);
    if (!s.ok()) return s;
    mirror_->Write(layer, part, k, v);
  }
  // Shapes in the order requests cycle through them: mixed alternates. Each
  // shape has its own pages; its variants share them.
  std::vector<size_t> first_page(specs.size(), 0);
  for (size_t i = 1; i < specs.size(); ++i) {
    first_page[i] = first_page[i - 1] + static_cast<size_t>(PagesPerClient({specs[i - 1]}, batch,
                                                                           g.page_size));
  }
  for (int variant = 0; variant < kVariants; ++variant) {
    for (size_t i = 0; i < specs.size(); ++i) {
      const ShapeSpec& s = specs[i];
      size_t next = first_page[i];
      shapes_.push_back(
          MakeShape(gen, g, s.name, batch, s.q_len, s.kv_len, layer, config.attention, pages_, &next));
      if (config.verify) {
        ReferencePrefill(*mirror_, shapes_.back().in, &shapes_.back().o_ref, &shapes_.back().lse_ref,
                         client_->info().fp8_query_min_rows(), &shapes_.back().lse_bound);
      }
    }
  }
  if (config.plan) {
    for (const BenchShape& sh : shapes_) {
      PlanLayout layout;
      layout.qo_indptr = sh.in.qo_indptr;
      layout.kv_indptr = sh.in.kv_indptr;
      layout.kv_indices = sh.in.kv_indices;
      layout.kv_last_page_len = sh.in.kv_last_page_len;
      layout.kv_keys_after = sh.in.kv_keys_after;
      layout.options = sh.in.options;  // the plan carries them; the Prefills do not
      auto id = client_->CreatePlan(layout);
      if (!id.ok()) return id.status();
      plan_ids_.push_back(*id);
    }
  }
  if (config.shm) {
    // One region for the largest shape: q, then the output, then the LSE;
    // with --channel the system region starts with the ring. With
    // --cuda_device the tensors are in a CUDA region of their own.
    int64_t rows = 0;
    for (const BenchShape& sh : shapes_) rows = std::max(rows, sh.in.total_q());
    const int64_t q_row = int64_t{g.num_qo_heads} * g.head_dim * KvDTypeBytes(g.dtype);
    const bool channel = config.channel;
    const int32_t cuda_device = config.cuda_device;
    // One slot (this worker sends one request at a time) of 1 MiB, room
    // for a layout of 250k page ids.
    const int64_t ring_bytes = channel ? ChannelBytes(1, kChannelSlotBytes) : 0;
    q_at_ = cuda_device >= 0 ? 0 : (ring_bytes + 4095) / 4096 * 4096;
    o_at_ = q_at_ + (rows * q_row + 4095) / 4096 * 4096;
    lse_at_ = o_at_ + (rows * q_row + 4095) / 4096 * 4096;
    const int64_t tensor_bytes = lse_at_ + rows * g.num_qo_heads * 4;
    region_ = absl::StrCat("attnbench-", getpid(), "-", index);
    tensor_region_ = region_;
    if (cuda_device >= 0) {
#ifdef ATTNSERVE_CLIENT_CUDA
      tensor_region_ = region_ + "-cuda";
      auto memory = CudaMemory::Create(cuda_device, tensor_bytes);
      if (!memory.ok()) return memory.status();
      cuda_ = *std::move(memory);
      absl::Status s = client_->RegisterCudaRegion(tensor_region_, cuda_->ipc_handle(),
                                                   cuda_device, cuda_->size());
      if (!s.ok()) return s;
#else
      return absl::UnimplementedError("--cuda_device: this attnbench was built without CUDA");
#endif
    }
    if (cuda_device < 0 || channel) {
      auto shm = SharedMemory::Create(region_, cuda_device >= 0 ? ring_bytes : tensor_bytes);
      if (!shm.ok()) return shm.status();
      shm_ = *std::move(shm);
      absl::Status s = client_->RegisterSystemRegion(region_, *shm_, 0, shm_->size());
      if (!s.ok()) return s;
    }
    if (channel) {
      ChannelOptions channel_options;
      channel_options.slot_count = 1;
      channel_options.slot_bytes = kChannelSlotBytes;
      channel_options.spin_us = options.busy_poll ? 10'000'000 : 100;
      auto opened = client_->OpenChannel(region_, shm_->data(), 0, ring_bytes, channel_options);
      if (!opened.ok()) return opened.status();
      channel_ = *std::move(opened);
    }
  }
  return absl::OkStatus();
}

void BenchWorker::SendOne(BenchClock::time_point start, LatencyStats* stats) {
  const bool verify = config_.verify;
  const size_t index = next_++ % shapes_.size();
  const BenchShape& shape = shapes_[index];
  PrefillArgs args = ArgsOf(shape.in);
  if (!plan_ids_.empty()) {
    args.plan_id = plan_ids_[index];
    args.qo_indptr = {};
    args.kv_indptr = {};
    args.kv_indices = {};
    args.kv_last_page_len = {};
    args.kv_keys_after = {};
    args.options = {};
    args.q_rows = shape.in.total_q();
  }
  const int64_t q_bytes = static_cast<int64_t>(shape.in.q.size()) * 2;
  const KvGeometry& geo = geo_;
  const int64_t lse_bytes = q_bytes / (2 * geo.head_dim) * 4;
  // An MLA server's outputs are v_head_dim wide: o_bytes of the region.
  const int64_t o_bytes = q_bytes / geo.head_dim * geo.VDim();
  const bool in_region = !tensor_region_.empty();
  if (in_region) {
    // Not timed: the query is where an engine would compute it.
    const BenchClock::time_point copy_start = BenchClock::now();
    absl::Status put = PutQuery(shape.in.q.data(), q_bytes);
    // Poisoned before a checked request: an output byte the server does
    // not write is a NaN the comparison counts.
    if (put.ok() && verify) put = PoisonOutputs(o_bytes, lse_bytes);
    start += BenchClock::now() - copy_start;
    if (!put.ok()) {
      stats->Record(0, put, false, shape.rows, shape.flops);
      return;
    }
    args.q = {};
    args.q_region = RegionRef{tensor_region_, q_at_, q_bytes};
    args.q_rows = shape.in.total_q();
    args.output_region = RegionRef{tensor_region_, o_at_, o_bytes};
    args.lse_region = RegionRef{tensor_region_, lse_at_, lse_bytes};
  }
  // Into the same result every time, as an engine reuses its buffers.
  absl::Status status = channel_ != nullptr ? channel_->PrefillInto(args, &result_)
                                            : client_->PrefillInto(args, &result_);
  const double latency = std::chrono::duration<double>(BenchClock::now() - start).count();
  if (status.ok() && in_region && verify) status = GetResult(o_bytes, lse_bytes);
  bool wrong = false;
  if (status.ok() && verify) {
    const KvDType dtype = geo_.dtype;
    const Comparison c = Compare(dtype, shape.o_ref, shape.lse_ref, result_.o, result_.lse, shape.lse_bound);
    wrong = !c.Ok(dtype);
    if (wrong) std::cerr << "\nwrong result (" << shape.name << "): " << c.ToString() << "\n";
  }
  stats->Record(latency, status, wrong, shape.rows, shape.flops);
  BackOffAfter(status);
}

// After UNAVAILABLE (a draining server, or one that is gone) the next
// request waits a random time in [0, backoff_s_], which doubles from 10 ms
// up to 1 s while the failures last; a success resets it. gRPC's retry
// policy (common/transport.h) has already retried the request itself.
void BenchWorker::BackOffAfter(const absl::Status& status) {
  if (!absl::IsUnavailable(status)) {
    backoff_s_ = 0;
    return;
  }
  backoff_s_ = std::clamp(backoff_s_ * 2, 0.01, 1.0);
  std::uniform_real_distribution<double> wait(0, backoff_s_);
  std::this_thread::sleep_for(std::chrono::duration<double>(wait(jitter_)));
}

// The query into the tensor region (untimed).
absl::Status BenchWorker::PutQuery(const uint16_t* q, int64_t q_bytes) {
#ifdef ATTNSERVE_CLIENT_CUDA
  if (cuda_ != nullptr) return cuda_->CopyIn(q_at_, q, q_bytes);
#endif
  std::memcpy(shm_->data() + q_at_, q, q_bytes);
  return absl::OkStatus();
}

// 0xff over the output and LSE in the tensor region (NaN halves and floats).
absl::Status BenchWorker::PoisonOutputs(int64_t o_bytes, int64_t lse_bytes) {
#ifdef ATTNSERVE_CLIENT_CUDA
  if (cuda_ != nullptr) {
    absl::Status s = cuda_->Fill(o_at_, o_bytes, 0xff);
    return s.ok() ? cuda_->Fill(lse_at_, lse_bytes, 0xff) : s;
  }
#endif
  std::memset(shm_->data() + o_at_, 0xff, o_bytes);
  std::memset(shm_->data() + lse_at_, 0xff, lse_bytes);
  return absl::OkStatus();
}

// The output and LSE from the tensor region into result_ (for --verify).
absl::Status BenchWorker::GetResult(int64_t o_bytes, int64_t lse_bytes) {
  result_.o.resize(o_bytes / 2);
  result_.lse.resize(lse_bytes / 4);
#ifdef ATTNSERVE_CLIENT_CUDA
  if (cuda_ != nullptr) {
    absl::Status s = cuda_->CopyOut(o_at_, result_.o.data(), o_bytes);
    return s.ok() ? cuda_->CopyOut(lse_at_, result_.lse.data(), lse_bytes) : s;
  }
#endif
  std::memcpy(result_.o.data(), shm_->data() + o_at_, o_bytes);
  std::memcpy(result_.lse.data(), shm_->data() + lse_at_, lse_bytes);
  return absl::OkStatus();
}

void BenchWorker::TearDown() {
  for (uint64_t id : plan_ids_) {
    absl::Status s = client_->ReleasePlan(id);
    if (!s.ok()) std::cerr << "release plan: " << s.ToString() << "\n";
  }
  plan_ids_.clear();
  channel_.reset();  // CloseChannel
  if (client_ != nullptr && shm_ != nullptr) {
    absl::Status s = client_->UnregisterRegion(region_);
    if (!s.ok()) std::cerr << "unregister region: " << s.ToString() << "\n";
    shm_.reset();
  }
#ifdef ATTNSERVE_CLIENT_CUDA
  if (client_ != nullptr && cuda_ != nullptr) {
    absl::Status s = client_->UnregisterRegion(tensor_region_);
    if (!s.ok()) std::cerr << "unregister region: " << s.ToString() << "\n";
    cuda_.reset();
  }
#endif
  if (client_ != nullptr && !pages_.empty()) {
    absl::Status s = client_->FreePages(pages_);
    if (!s.ok()) std::cerr << "free pages: " << s.ToString() << "\n";
  }
  pages_.clear();
  lease_.reset();  // revokes what is left
}

}  // namespace attnserve
