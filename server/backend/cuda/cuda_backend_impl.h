// The CUDA backend's class, shared by its two files: cuda_backend.cc (Init,
// and the batched attention path: Submit, Launch, Complete) and
// cuda_backend_kv.cc (what runs on an idle backend: KV writes and reads,
// page zeroing, FP8 scales, MergeStates). Internal to the backend: the rest
// of the server sees Backend and MakeCudaBackend (cuda_backend.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/kv_geometry.h"
#include "server/backend/backend.h"
#include "server/backend/cuda/batch_packer.h"
#include "server/backend/cuda/cuda_region_device.h"
#include "server/backend/cuda/staging_ring.h"
#include "server/backend/factory.h"
#include "server/backend/host_buffer.h"

namespace attnserve {
namespace cuda_backend_internal {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendOptions& options)
      : options_(options), geo_(options.geometry), region_device_(MakeCudaRegionDevice(options.device)) {}

  ~CudaBackend() override {
    cudaSetDevice(options_.device);
    for (cudaStream_t st : {copy_in_, compute_, copy_out_}) {
      if (st != nullptr) cudaStreamSynchronize(st);
    }
    ring_.reset();  // its buffers and events, before the streams go
    for (cudaStream_t st : {copy_in_, compute_, copy_out_}) {
      if (st != nullptr) cudaStreamDestroy(st);
    }
    const void* device_ptrs[] = {k_pool_, v_pool_, d_part_o_, d_part_lse_, d_counters_, d_k_scales_,
                                 d_v_scales_};
    for (const void* p : device_ptrs) cudaFree(const_cast<void*>(p));
  }

  absl::Status Init();

  std::string Name() const override { return "cuda"; }
  std::string Device() const override { return device_name_; }
  MemoryUsage Memory() const override { return memory_; }
  const KvGeometry& Geometry() const override { return geo_; }
  int32_t Fp8QueryMinRows() const override { return fp8_query_min_rows_; }

  // Outputs of at least kDirectOutputBytes get a pinned buffer the download
  // lands in (no unpack copy); smaller ones cost less to unpack from staging
  // than to download one by one, and come from the heap.
  HostBuffer AllocateOutput(int64_t bytes) override {
    if (bytes >= kDirectOutputBytes && output_pool_ != nullptr) return output_pool_->Get(bytes);
    return HeapBuffer(bytes);
  }

  RegionDevice* region_device() override { return region_device_.get(); }

  int PipelineDepth() const override { return StagingRing::kSlots; }
  absl::Status Submit(absl::Span<const PrefillTask> tasks, BatchStats* stats) override;
  absl::Status Complete(BatchStats* stats) override;
  absl::Status WriteKv(const KvRows& rows, BatchStats* stats) override { return CopyRows(rows, true, stats); }
  absl::Status ReadKv(const KvRows& rows, BatchStats* stats) override { return CopyRows(rows, false, stats); }
  // On the device: only the page ids cross PCIe, not the zeros.
  absl::Status ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) override;
  // One layer's scales copied to the device arrays the kernels read.
  absl::Status SetKvScales(int32_t layer, absl::Span<const float> k_scales,
                           absl::Span<const float> v_scales) override;
  // MergeStates of host tensors stays on the CPU: a GPU pass would move every
  // byte over PCIe (tens of GB/s, after a copy into pinned staging) where the
  // CPU reads it once at memory speed. States in CUDA regions merge on the
  // GPU (MergeStatesOnDevice).
  absl::Status MergeStates(const MergeStatesParams& params, const MergeOnDevice& on_device) override;

 private:
  // Queues one packed batch's upload, kernels and download on the streams.
  absl::Status Launch(absl::Span<const PrefillTask> tasks, const PackedBatch& b, StagingRing::Slot& slot);
  // WriteKv (scatter) and ReadKv (gather), in chunks of the staging.
  absl::Status CopyRows(const KvRows& rows, bool scatter, BatchStats* stats);
  // Packs slots / k / v of rows [begin, begin + n) of `rows` for WriteKv.
  absl::Status CopyRowsChunk(const KvRows& rows, int64_t begin, int64_t n, bool scatter,
                             float* seconds);
  // FailedPrecondition unless no batch is in flight (WriteKv / ReadKv use
  // the idle slot's staging and the compute stream synchronously).
  absl::Status CheckIdle();
  // MergeStates with every tensor in device memory: the merge kernel reads
  // the states where they are (a peer's memory over NVLink) and writes the
  // outputs there.
  absl::Status MergeOnGpu(const MergeStatesParams& params);
  // Any other mix of host and device tensors (or more states than one launch
  // takes, or addresses the kernel's 16-byte loads cannot use): device
  // tensors are copied to host memory, merged by the CPU, and copied back.
  absl::Status MergeThroughHost(const MergeStatesParams& params, const MergeOnDevice& on_device);

  BackendOptions options_;
  KvGeometry geo_;
  std::unique_ptr<RegionDevice> region_device_;
  std::string device_name_;
  int32_t fp8_query_min_rows_ = 0;  // Fp8QueryMinRows
  MemoryUsage memory_;  // read once Init has allocated everything
  int64_t max_append_ = 0;
  // Pinned response buffers (AllocateOutput), at most the size class of one
  // batch's output staging in all; blocks are pinned on first use and then
  // recycled.
  static constexpr int64_t kDirectOutputBytes = SizeClassPool::kMinClass;
  std::shared_ptr<SizeClassPool> output_pool_;

  void* k_pool_ = nullptr;
  void* v_pool_ = nullptr;
  float* d_part_o_ = nullptr;
  float* d_part_lse_ = nullptr;
  int32_t* d_counters_ = nullptr;  // decode split tiles; zero between launches
  // FP8 pools: (num_layers, num_kv_heads) K and V scales (null otherwise).
  float* d_k_scales_ = nullptr;
  float* d_v_scales_ = nullptr;

  std::optional<BatchPacker> packer_;  // used by Submit's thread only
  std::unique_ptr<StagingRing> ring_;
  cudaStream_t copy_in_ = nullptr;
  cudaStream_t compute_ = nullptr;
  cudaStream_t copy_out_ = nullptr;
};

}  // namespace cuda_backend_internal
}  // namespace attnserve
