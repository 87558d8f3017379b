// HostBuffer: host memory for one response's outputs, handed out by the
// backend (Backend::AllocateOutput) and owned by whoever holds it last.
//
// The gRPC edge sends a Prefill response straight from this memory (the
// response's slices point into it), so the buffer outlives the core's call
// and is released on whichever thread gRPC drops the slice. A buffer is never
// zero-filled: the backend writes every byte of it before the response is
// sent.
//
// Sources:
//   HeapSource():     plain malloc / free.
//   SizeClassPool:    recycles blocks by size class up to a byte bound, from
//                     an allocator the owner supplies (the CUDA backend's is
//                     cudaHostAlloc, so the device can DMA into the blocks).
//                     Blocks are kept for reuse, never returned before the
//                     pool is destroyed; a request the bound cannot meet
//                     falls back to the heap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace attnserve {

// Where a HostBuffer's memory came from and goes back to. Thread-safe.
class BufferSource {
 public:
  virtual ~BufferSource() = default;
  virtual void Release(void* data, int64_t capacity) = 0;
};

class HostBuffer {
 public:
  HostBuffer() = default;
  // `source` takes the memory back when the buffer is destroyed; keeping a
  // reference to it keeps the source alive for as long as the buffer is.
  HostBuffer(void* data, int64_t size, int64_t capacity, bool pinned,
             std::shared_ptr<BufferSource> source)
      : data_(static_cast<char*>(data)),
        size_(size),
        capacity_(capacity),
        pinned_(pinned),
        source_(std::move(source)) {}
  HostBuffer(HostBuffer&& other) noexcept { *this = std::move(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      capacity_ = std::exchange(other.capacity_, 0);
      pinned_ = std::exchange(other.pinned_, false);
      source_ = std::move(other.source_);
    }
    return *this;
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { Reset(); }

  char* data() const { return data_; }
  int64_t size() const { return size_; }
  // Page-locked memory the device may copy into directly.
  bool pinned() const { return pinned_; }

  void Reset() {
    if (data_ != nullptr && source_ != nullptr) source_->Release(data_, capacity_);
    data_ = nullptr;
    size_ = capacity_ = 0;
    pinned_ = false;
    source_.reset();
  }

 private:
  char* data_ = nullptr;
  int64_t size_ = 0;
  int64_t capacity_ = 0;
  bool pinned_ = false;
  std::shared_ptr<BufferSource> source_;
};

// malloc'd buffers. Returns an empty buffer (data() == nullptr) when malloc
// fails or bytes is 0.
HostBuffer HeapBuffer(int64_t bytes);

// Blocks by size class (64 KiB, 96 KiB, 128 KiB, 192 KiB, ...: at most a
// third of a block unused), at most max_bytes of blocks in all.
class SizeClassPool final : public BufferSource,
                            public std::enable_shared_from_this<SizeClassPool> {
 public:
  struct Allocator {
    std::function<void*(int64_t bytes)> allocate;  // nullptr on failure
    std::function<void(void* data)> free;
    bool pinned = false;  // what HostBuffer::pinned() reports for its blocks
  };

  static std::shared_ptr<SizeClassPool> Create(Allocator allocator, int64_t max_bytes) {
    return std::shared_ptr<SizeClassPool>(new SizeClassPool(std::move(allocator), max_bytes));
  }
  ~SizeClassPool() override;

  // A block of at least `bytes` (bytes > 0), or a heap buffer when the pool
  // is at its bound or its allocator fails.
  HostBuffer Get(int64_t bytes);

  void Release(void* data, int64_t capacity) override;

  static constexpr int64_t kMinClass = int64_t{64} << 10;
  static int64_t ClassBytes(int64_t bytes);

  // For tests and metrics.
  int64_t allocated_bytes() const;
  int64_t pooled_blocks() const;
  int64_t heap_fallbacks() const;

 private:
  SizeClassPool(Allocator allocator, int64_t max_bytes)
      : allocator_(std::move(allocator)), max_bytes_(max_bytes) {}

  const Allocator allocator_;
  const int64_t max_bytes_;
  mutable absl::Mutex mu_;
  // Free blocks by class size.
  std::vector<std::pair<int64_t, std::vector<void*>>> free_ ABSL_GUARDED_BY(mu_);
  int64_t allocated_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t heap_fallbacks_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve
