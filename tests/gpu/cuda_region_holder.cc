// cuda_region_holder: a client process for cuda_region_gpu_test.cc. It
// allocates two device buffers on DEVICE, fills them with random bytes,
// registers them as CUDA regions PREFIX0 and PREFIX1, prints "ready" and
// waits until it is killed, never unregistering.
//
//   cuda_region_holder TARGET TOKEN PREFIX BYTES DEVICE
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/cuda_memory.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: cuda_region_holder TARGET TOKEN PREFIX BYTES DEVICE\n");
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
  const int device = std::atoi(argv[5]);
  std::mt19937_64 gen(77);
  std::vector<unsigned char> fill(bytes);
  for (auto& b : fill) b = static_cast<unsigned char>(gen());
  std::vector<std::unique_ptr<attnserve::CudaMemory>> held;
  for (int i = 0; i < 2; ++i) {
    auto memory = attnserve::CudaMemory::Create(device, bytes);
    absl::Status s = memory.ok() ? (*memory)->CopyIn(0, fill.data(), bytes) : memory.status();
    if (!s.ok()) {
      std::fprintf(stderr, "cuda: %s\n", s.ToString().c_str());
      return 1;
    }
    s = (*client)->RegisterCudaRegion(std::string(argv[3]) + std::to_string(i),
                                      (*memory)->ipc_handle(), device, bytes);
    if (!s.ok()) {
      std::fprintf(stderr, "register: %s\n", s.ToString().c_str());
      return 1;
    }
    held.push_back(*std::move(memory));
  }
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) pause();
}
