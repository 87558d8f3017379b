// region_holder: a client process for regions_test.cc and channel_test.cc.
// It creates a sealed memfd, fills it with random bf16 values from a seed,
// registers it as a system region (the region's name is the memfd's),
// prints "ready" and waits until it is killed, never unregistering. With
// `channel`, it also opens a request channel (one slot of 4 KiB) at the
// start of the region before it prints "ready", and leaves it open.
//
//   region_holder TARGET TOKEN NAME BYTES SEED [channel]
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "client/channel.h"
#include "client/client.h"
#include "client/shared_memory.h"
#include "client/workload.h"

int main(int argc, char** argv) {
  if (argc != 6 && !(argc == 7 && std::strcmp(argv[6], "channel") == 0)) {
    std::fprintf(stderr, "usage: region_holder TARGET TOKEN NAME BYTES SEED [channel]\n");
    return 2;
  }
  attnserve::ClientOptions options;
  options.target = argv[1];
  options.token = argv[2];
  auto client = attnserve::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  const int64_t bytes = std::atoll(argv[4]);
  auto shm = attnserve::SharedMemory::Create(argv[3], bytes);
  if (!shm.ok()) {
    std::fprintf(stderr, "shm: %s\n", shm.status().ToString().c_str());
    return 1;
  }
  std::mt19937_64 gen(std::strtoull(argv[5], nullptr, 10));
  const auto values = attnserve::RandomHalves(gen, attnserve::KvDType::kBf16, bytes / 2);
  std::memcpy((*shm)->data(), values.data(), values.size() * 2);
  absl::Status s = (*client)->RegisterSystemRegion(argv[3], **shm, 0, bytes);
  if (!s.ok()) {
    std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
    return 1;
  }
  std::unique_ptr<attnserve::RequestChannel> channel;
  if (argc == 7) {
    attnserve::ChannelOptions channel_options;
    channel_options.slot_count = 1;
    channel_options.slot_bytes = 4096;
    auto opened = (*client)->OpenChannel(argv[3], (*shm)->data(), 0, bytes, channel_options);
    if (!opened.ok()) {
      std::fprintf(stderr, "channel: %s\n", opened.status().ToString().c_str());
      return 1;
    }
    channel = *std::move(opened);
  }
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) pause();
}
