// lease_holder: a client process for lease_test.cc. It holds a lease of
// TTL_MS kept alive by a LeaseKeeper, allocates PAGES pages and registers a
// step plan over them under it, prints "ready" and waits to be killed.
//
//   lease_holder TARGET TTL_MS PAGES
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "client/client.h"
#include "client/lease.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: lease_holder TARGET TTL_MS PAGES\n");
    return 2;
  }
  attnserve::ClientOptions options;
  options.target = argv[1];
  auto client = attnserve::Client::Connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto lease = attnserve::LeaseKeeper::Start(client->get(), std::atoll(argv[2]));
  if (!lease.ok()) {
    std::fprintf(stderr, "lease: %s\n", lease.status().ToString().c_str());
    return 1;
  }
  const int32_t n = std::atoi(argv[3]);
  auto pages = (*client)->AllocatePages(n);
  if (!pages.ok()) {
    std::fprintf(stderr, "allocate: %s\n", pages.status().ToString().c_str());
    return 1;
  }
  const int32_t page_size = (*client)->info().page_size();
  const std::vector<int32_t> qo_indptr = {0, 1}, kv_indptr = {0, n}, last = {page_size};
  const std::vector<int64_t> append = {int64_t{pages->back()} * page_size + page_size - 1};
  auto plan = (*client)->CreatePlan({qo_indptr, kv_indptr, *pages, last, append});
  if (!plan.ok()) {
    std::fprintf(stderr, "plan: %s\n", plan.status().ToString().c_str());
    return 1;
  }
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) pause();
}
