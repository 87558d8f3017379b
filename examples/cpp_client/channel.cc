// cpp_channel: a decode step through a request channel (docs/transport.md,
// "Request channels") with the installed C++ client, on a server of this
// host started with --allow_shared_memory.
//
// Writes the keys and values of kBatch sequences, then runs the same decode
// (one query row per sequence, q, output and LSE in a shared-memory region)
// through a request channel and as a plain Prefill call, and checks that both
// give the same bytes.
//
//   cpp_channel [HOST:PORT]        (default 127.0.0.1:50051)
//
// Exit code 0 when every call succeeded and the results agree.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnserve/client/channel.h"
#include "attnserve/client/client.h"
#include "attnserve/client/shared_memory.h"
#include "attnserve/common/dtype.h"

namespace {

constexpr int kBatch = 8;    // sequences, one query row each
constexpr int kKvLen = 33;   // tokens per sequence

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "cpp_channel: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  attnserve::ClientOptions options;
  options.target = argc > 1 ? argv[1] : "127.0.0.1:50051";
  options.timeout_s = 30;  // a channel call of a server that died fails after this
  auto connected = attnserve::Client::Connect(options);
  if (!connected.ok()) return Fail("connect", connected.status());
  auto& client = *connected;
  const attnserve::KvGeometry geo = attnserve::GeometryOf(client->info());

  // kBatch sequences of kKvLen tokens, pages in order, random K/V in layer 0.
  const int pages_per_seq = (kKvLen + geo.page_size - 1) / geo.page_size;
  auto pages = client->AllocatePages(kBatch * pages_per_seq);
  if (!pages.ok()) return Fail("AllocatePages", pages.status());
  std::vector<int64_t> slots;
  std::vector<int32_t> qo_indptr = {0}, kv_indptr = {0}, kv_last_page_len;
  for (int b = 0; b < kBatch; ++b) {
    for (int t = 0; t < kKvLen; ++t) {
      const int32_t page = (*pages)[b * pages_per_seq + t / geo.page_size];
      slots.push_back(int64_t{page} * geo.page_size + t % geo.page_size);
    }
    qo_indptr.push_back(b + 1);
    kv_indptr.push_back((b + 1) * pages_per_seq);
    kv_last_page_len.push_back(kKvLen - (pages_per_seq - 1) * geo.page_size);
  }
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random = [&](size_t n) {
    std::vector<uint16_t> v(n);
    for (uint16_t& x : v) x = attnserve::FloatToHalf(geo.dtype, normal(gen));
    return v;
  };
  const size_t kv_elems = slots.size() * geo.num_kv_heads * geo.head_dim;
  absl::Status written = client->WriteKV(0, slots, random(kv_elems), random(kv_elems));
  if (!written.ok()) return Fail("WriteKV", written);
  const std::vector<uint16_t> q = random(size_t{kBatch} * geo.num_qo_heads * geo.head_dim);
  const int64_t q_bytes = static_cast<int64_t>(q.size()) * 2;
  const int64_t lse_bytes = int64_t{kBatch} * geo.num_qo_heads * 4;

  // --- the part docs/transport.md shows ---
  // One memfd for the ring and the tensors, registered as a region.
  attnserve::ChannelOptions channel_options;  // 4 slots of 1 MiB
  const int64_t ring_bytes =
      attnserve::ChannelBytes(channel_options.slot_count, channel_options.slot_bytes);
  const int64_t q_at = ring_bytes, o_at = q_at + q_bytes, lse_at = o_at + q_bytes;
  auto shm = attnserve::SharedMemory::Create("cpp_channel", lse_at + lse_bytes);
  if (!shm.ok()) return Fail("SharedMemory", shm.status());
  absl::Status registered = client->RegisterSystemRegion("io", **shm, 0, (*shm)->size());
  if (!registered.ok()) return Fail("RegisterSystemRegion", registered);
  auto channel = client->OpenChannel("io", (*shm)->data(), /*offset=*/0, ring_bytes,
                                     channel_options);
  if (!channel.ok()) return Fail("OpenChannel", channel.status());

  std::memcpy((*shm)->data() + q_at, q.data(), q_bytes);  // where an engine computes q
  attnserve::PrefillArgs args;
  args.qo_indptr = qo_indptr;
  args.kv_indptr = kv_indptr;
  args.kv_indices = *pages;
  args.kv_last_page_len = kv_last_page_len;
  args.q_region = attnserve::RegionRef{"io", q_at, q_bytes};
  args.q_rows = kBatch;
  args.output_region = attnserve::RegionRef{"io", o_at, q_bytes};
  args.lse_region = attnserve::RegionRef{"io", lse_at, lse_bytes};
  auto out = (*channel)->Prefill(args);  // no gRPC call: the request goes through the ring
  if (!out.ok()) return Fail("channel Prefill", out.status());
  // The output and LSE are at (*shm)->data() + o_at and + lse_at.
  // --- end of the part docs/transport.md shows ---

  // The same decode over gRPC, inline: the same bytes.
  attnserve::PrefillArgs inline_args = args;
  inline_args.q = q;
  inline_args.q_region.reset();
  inline_args.output_region.reset();
  inline_args.lse_region.reset();
  auto expected = client->Prefill(inline_args);
  if (!expected.ok()) return Fail("Prefill", expected.status());
  const bool same =
      std::memcmp((*shm)->data() + o_at, expected->o.data(), q_bytes) == 0 &&
      std::memcmp((*shm)->data() + lse_at, expected->lse.data(), lse_bytes) == 0;
  std::printf("cpp_channel: decode of %d sequences through channel %llu: %s\n", kBatch,
              static_cast<unsigned long long>((*channel)->id()),
              same ? "same bytes as over gRPC: OK" : "DIFFERS from gRPC");
  channel->reset();  // CloseChannel
  client->UnregisterRegion("io").IgnoreError();
  client->FreePages(*pages).IgnoreError();
  return same ? 0 : 1;
}
