#include "server/backend/host_buffer.h"

#include <algorithm>
#include <cstdlib>

namespace attnserve {
namespace {

class HeapSource final : public BufferSource {
 public:
  void Release(void* data, int64_t) override { std::free(data); }
};

const std::shared_ptr<BufferSource>& Heap() {
  static const auto* heap = new std::shared_ptr<BufferSource>(std::make_shared<HeapSource>());
  return *heap;
}

}  // namespace

HostBuffer HeapBuffer(int64_t bytes) {
  if (bytes <= 0) return HostBuffer();
  void* data = std::malloc(static_cast<size_t>(bytes));
  if (data == nullptr) return HostBuffer();
  return HostBuffer(data, bytes, bytes, /*pinned=*/false, Heap());
}

int64_t SizeClassPool::ClassBytes(int64_t bytes) {
  int64_t size = kMinClass;
  while (size < bytes) {
    // 2^k, then 1.5 * 2^k, then 2^(k+1).
    const bool power_of_two = (size & (size - 1)) == 0;
    size = power_of_two ? size + size / 2 : size / 3 * 4;
  }
  return size;
}

SizeClassPool::~SizeClassPool() {
  for (auto& [size, blocks] : free_) {
    for (void* block : blocks) allocator_.free(block);
  }
}

HostBuffer SizeClassPool::Get(int64_t bytes) {
  if (bytes <= 0) return HostBuffer();
  const int64_t size = ClassBytes(bytes);
  {
    absl::MutexLock lock(&mu_);
    for (auto& [class_size, blocks] : free_) {
      if (class_size == size && !blocks.empty()) {
        void* block = blocks.back();
        blocks.pop_back();
        return HostBuffer(block, bytes, size, allocator_.pinned, shared_from_this());
      }
    }
    if (allocated_bytes_ + size > max_bytes_) {
      ++heap_fallbacks_;
      return HeapBuffer(bytes);
    }
    allocated_bytes_ += size;  // reserved while the allocator runs
  }
  void* block = allocator_.allocate(size);
  if (block == nullptr) {
    absl::MutexLock lock(&mu_);
    allocated_bytes_ -= size;
    ++heap_fallbacks_;
    return HeapBuffer(bytes);
  }
  return HostBuffer(block, bytes, size, allocator_.pinned, shared_from_this());
}

void SizeClassPool::Release(void* data, int64_t capacity) {
  absl::MutexLock lock(&mu_);
  for (auto& [class_size, blocks] : free_) {
    if (class_size == capacity) {
      blocks.push_back(data);
      return;
    }
  }
  free_.emplace_back(capacity, std::vector<void*>{data});
}

int64_t SizeClassPool::allocated_bytes() const {
  absl::MutexLock lock(&mu_);
  return allocated_bytes_;
}

int64_t SizeClassPool::pooled_blocks() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [size, blocks] : free_) n += static_cast<int64_t>(blocks.size());
  return n;
}

int64_t SizeClassPool::heap_fallbacks() const {
  absl::MutexLock lock(&mu_);
  return heap_fallbacks_;
}

}  // namespace attnserve
