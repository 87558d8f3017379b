// libFuzzer target over request parsing and validation for every RPC.
//
// The first input byte picks the RPC; the rest is parsed as that RPC's
// request proto, converted by the edge's own code (server/grpc/convert.h)
// and handed to a real AttentionCore on the CPU backend, exactly as the
// server does. Tenant "a" sends everything; tenant "b" owns pages whose K/V
// are checked after every input: no input may crash the core, leave a done
// callback unrun, or change another tenant's data.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <vector>

#include "server/core/attention_core.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/grpc/convert.h"
#include "server/grpc/message_pool.h"

namespace attnserve {
namespace {

CallContext Tenant(const char* tenant) {
  CallContext c;
  c.tenant = tenant;
  return c;
}

struct Harness {
  Metrics metrics;
  std::unique_ptr<AttentionCore> core;
  std::vector<int64_t> b_slots;
  std::string b_k, b_v;  // tenant b's rows as written

  Harness() {
    KvGeometry g;
    g.num_layers = 2;
    g.num_pages = 16;
    g.page_size = 4;
    g.num_qo_heads = 4;
    g.num_kv_heads = 2;
    g.head_dim = 64;
    CoreOptions options;
    options.max_batch_tokens = 64;
    options.max_message_bytes = 1 << 20;
    options.max_request_kv_indices = 4096;
    core = std::make_unique<AttentionCore>(options, *CpuBackend::Create(g), &metrics);
    // Pages 0..7 for tenant a (the fuzzer's), 8..11 for tenant b.
    (void)core->AllocatePages(Tenant("a"), 8);
    auto b_pages = core->AllocatePages(Tenant("b"), 4);
    for (int32_t p : *b_pages) {
      for (int o = 0; o < g.page_size; ++o) b_slots.push_back(int64_t{p} * g.page_size + o);
    }
    const size_t bytes = b_slots.size() * g.RowElems() * 2;
    b_k.resize(bytes);
    b_v.resize(bytes);
    for (size_t i = 0; i < bytes; ++i) {
      b_k[i] = static_cast<char>(i * 7 + 1);
      b_v[i] = static_cast<char>(i * 13 + 5);
    }
    for (int layer = 0; layer < g.num_layers; ++layer) {
      WriteKvCall w;
      w.tenant = "b";
      w.layer = layer;
      w.slots = b_slots;
      w.k = {TensorDType::kBf16, {static_cast<int64_t>(b_slots.size()), g.num_kv_heads, g.head_dim}, b_k};
      w.v = {TensorDType::kBf16, {static_cast<int64_t>(b_slots.size()), g.num_kv_heads, g.head_dim}, b_v};
      if (!Wait([&](DoneCallback done) { core->WriteKv(w, std::move(done)); }).ok()) std::abort();
    }
  }

  // Runs an asynchronous core call and waits for its done callback.
  template <typename Fn>
  absl::Status Wait(Fn&& fn) {
    std::promise<absl::Status> promise;
    auto future = promise.get_future();
    fn([&promise](absl::Status s) { promise.set_value(std::move(s)); });
    return future.get();
  }

  void CheckTenantB() {
    const KvGeometry& g = core->geometry();
    for (int layer = 0; layer < g.num_layers; ++layer) {
      std::string k, v;
      ReadKvCall r;
      r.tenant = "b";
      r.layer = layer;
      r.slots = b_slots;
      r.out_k = &k;
      r.out_v = &v;
      if (!Wait([&](DoneCallback done) { core->ReadKv(r, std::move(done)); }).ok()) std::abort();
      if (k != b_k || v != b_v) std::abort();  // another tenant's KV changed
    }
  }
};

Harness& H() {
  static Harness* h = new Harness();
  return *h;
}

}  // namespace
}  // namespace attnserve

namespace attnserve {
// ATTNSERVE_FUZZ_VERBOSE=1 prints each input's status (to check the corpus).
void Report(const char* rpc, const absl::Status& s) {
  static const bool verbose = std::getenv("ATTNSERVE_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "%s: %s\n", rpc, s.ToString().c_str());
}
}  // namespace attnserve

namespace attnserve {
// The server's limits for the fuzz harness's core, as the service builds them.
const RequestWireLimits& Limits() {
  static const RequestWireLimits* limits = new RequestWireLimits(
      H().core->limits().max_request_rows, H().core->limits().max_request_kv_indices,
      H().core->geometry().num_pages, kMaxMergeStates);
  return *limits;
}

// The body in slices of 1 to 64 bytes (sizes from its own bytes), as gRPC
// may hand a request over.
grpc::ByteBuffer Sliced(const void* body, int size) {
  const auto* p = static_cast<const uint8_t*>(body);
  std::vector<grpc::Slice> slices;
  for (int at = 0; at < size;) {
    const int n = std::min(size - at, 1 + p[at] % 64);
    slices.emplace_back(p + at, static_cast<size_t>(n));
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// As the server's handlers: the wire limits, then the bounded parse.
bool ParseBody(const void* body, int size, const WireMessage& limits,
               google::protobuf::MessageLite* request) {
  grpc::Slice slice(body, static_cast<size_t>(size));
  return ParseInto(grpc::ByteBuffer(&slice, 1), limits, request).ok();
}
}  // namespace attnserve

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  if (size < 1) return 0;
  Harness& h = H();
  const uint8_t rpc = data[0] % 5;
  const void* body = data + 1;
  const int body_size = static_cast<int>(size - 1);
  switch (rpc) {
    case 0: {
      // As the server's raw Prefill handler: parsed into a recycled request,
      // the response encoded from the output buffer and parsed back.
      static auto* pool = new RecyclingPool<v1::PrefillRequest>(
          2, 64 << 20, [](v1::PrefillRequest* r) { return ResetForReuse(r); });
      // Its tensors' data is read in place, from slices of up to 64 bytes.
      RecyclingPool<v1::PrefillRequest>::Ptr req = pool->Get();
      InPlaceTensors tensors;
      if (!ParseInto(Sliced(body, body_size), Limits().prefill, kPrefillInPlace, req.get(),
                     &tensors)
               .ok()) {
        return 0;
      }
      PrefillOutput out;
      PrefillCall c;
      ToCall(*req, tensors, &c);
      c.out = &out;
      c.tenant = "a";
      c.expected_incarnation = req->expected_incarnation();
      absl::Status s = h.Wait([&](DoneCallback done) { h.core->Prefill(c, std::move(done)); });
      Report("Prefill", s);
      if (!s.ok()) break;
      const KvGeometry& g = h.core->geometry();
      const int64_t total_q = c.q.shape[0];
      grpc::Slice wire;
      if (!EncodePrefillResponse(std::move(out), 1).DumpToSingleSlice(&wire).ok()) {
        std::abort();
      }
      v1::PrefillResponse resp;
      if (!resp.ParseFromArray(wire.begin(), static_cast<int>(wire.size())) ||
          resp.lse().data().size() != static_cast<size_t>(total_q) * g.num_qo_heads * 4 ||
          resp.output().data().size() !=
              static_cast<size_t>(total_q * g.num_qo_heads * g.head_dim * KvDTypeBytes(g.dtype))) {
        std::abort();  // an accepted request must get a whole output and LSE
      }
      break;
    }
    case 1: {
      v1::WriteKVRequest req;
      InPlaceTensors tensors;
      if (!ParseInto(Sliced(body, body_size), Limits().write_kv, kWriteKvInPlace, &req, &tensors)
               .ok()) {
        return 0;
      }
      WriteKvCall c;
      ToCall(req, tensors, &c);
      c.tenant = "a";
      c.expected_incarnation = req.expected_incarnation();
      Report("WriteKV", h.Wait([&](DoneCallback done) { h.core->WriteKv(c, std::move(done)); }));
      break;
    }
    case 2: {
      v1::ReadKVRequest req;
      if (!ParseBody(body, body_size, Limits().read_kv, &req)) return 0;
      v1::ReadKVResponse resp;
      ReadKvCall c;
      ToCall(req, &resp, &c);
      c.tenant = "a";
      c.expected_incarnation = req.expected_incarnation();
      Report("ReadKV", h.Wait([&](DoneCallback done) { h.core->ReadKv(c, std::move(done)); }));
      break;
    }
    case 3: {
      v1::MergeStatesRequest req;
      if (!ParseBody(body, body_size, Limits().merge_states, &req)) return 0;
      v1::MergeStatesResponse resp;
      MergeStatesCall c;
      ToCall(req, &resp, &c);
      c.tenant = "a";
      Report("MergeStates",
             h.Wait([&](DoneCallback done) { h.core->MergeStates(c, std::move(done)); }));
      break;
    }
    case 4: {
      // Allocate then free what was given, or free arbitrary ids.
      v1::FreePagesRequest req;
      if (!ParseBody(body, body_size, Limits().free_pages, &req)) return 0;
      CallContext a;
      a.tenant = "a";
      auto given = h.core->AllocatePages(a, req.page_ids_size() % 4 + 1);
      const auto ids = absl::MakeConstSpan(req.page_ids().data(),
                                           static_cast<size_t>(req.page_ids_size()));
      Report("FreePages",
             h.Wait([&](DoneCallback done) { h.core->FreePages(a, ids, std::move(done)); }));
      if (given.ok()) {
        (void)h.Wait([&](DoneCallback done) { h.core->FreePages(a, *given, std::move(done)); });
      }
      break;
    }
  }
  h.CheckTenantB();
  return 0;
}
