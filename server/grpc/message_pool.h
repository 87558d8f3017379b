// RecyclingPool: hands out objects (request messages) and takes them back
// for the next call instead of deleting them.
//
// A Prefill request carries its layout's arrays (page ids, indptrs, slots),
// up to MiBs of them. Parsed into a fresh message, every call mallocs those
// arrays and faults their pages in. A recycled request (ResetForReuse in
// convert.h) parses into memory that is already mapped: clearing a repeated
// field or a string keeps its capacity. (The server's edge reads Prefill's
// tensors in place: their data never lands in the message.)
//
// Memory stays bounded: a returned object goes back to the pool only while
// the pool holds fewer than max_pooled objects and at most max_pooled_bytes
// of buffer capacity in all; any other is deleted, so one huge request does
// not keep its buffers for the rest of the process.
//
//   RecyclingPool<v1::PrefillRequest> pool(256, 256 << 20, ResetForReuse);
//   RecyclingPool<v1::PrefillRequest>::Ptr request = pool.Get();
//   ...  // the request goes back to the pool when `request` is destroyed
// where ResetForReuse(request) clears it for the next call, keeping whatever
// buffers it wants reused, and returns the bytes of capacity kept. The pool
// must outlive every Ptr it handed out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace attnserve {

template <typename T>
class RecyclingPool {
 public:
  // Clears an object for reuse; returns the bytes of buffer capacity it kept.
  using ResetFn = std::function<int64_t(T*)>;

  class Recycler {
   public:
    explicit Recycler(RecyclingPool* pool = nullptr) : pool_(pool) {}
    void operator()(T* object) const {
      if (pool_ != nullptr) {
        pool_->Recycle(object);
      } else {
        delete object;
      }
    }

   private:
    RecyclingPool* pool_;
  };
  using Ptr = std::unique_ptr<T, Recycler>;

  RecyclingPool(size_t max_pooled, int64_t max_pooled_bytes, ResetFn reset)
      : max_pooled_(max_pooled), max_pooled_bytes_(max_pooled_bytes), reset_(std::move(reset)) {}
  RecyclingPool(const RecyclingPool&) = delete;
  RecyclingPool& operator=(const RecyclingPool&) = delete;

  ~RecyclingPool() {
    for (auto& entry : free_) delete entry.first;
  }

  // A pooled object if there is one, else a new one.
  Ptr Get() {
    {
      absl::MutexLock lock(&mu_);
      if (!free_.empty()) {
        auto [object, bytes] = free_.back();
        free_.pop_back();
        pooled_bytes_ -= bytes;
        return Ptr(object, Recycler(this));
      }
    }
    return Ptr(new T(), Recycler(this));
  }

  // Objects and buffer bytes held for reuse now (for tests).
  size_t pooled() const {
    absl::MutexLock lock(&mu_);
    return free_.size();
  }
  int64_t pooled_bytes() const {
    absl::MutexLock lock(&mu_);
    return pooled_bytes_;
  }

 private:
  void Recycle(T* object) {
    const int64_t bytes = reset_(object);
    {
      absl::MutexLock lock(&mu_);
      if (free_.size() < max_pooled_ && pooled_bytes_ + bytes <= max_pooled_bytes_) {
        pooled_bytes_ += bytes;
        free_.emplace_back(object, bytes);
        return;
      }
    }
    delete object;
  }

  const size_t max_pooled_;
  const int64_t max_pooled_bytes_;
  const ResetFn reset_;
  mutable absl::Mutex mu_;
  std::vector<std::pair<T*, int64_t>> free_ ABSL_GUARDED_BY(mu_);
  int64_t pooled_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attnserve
