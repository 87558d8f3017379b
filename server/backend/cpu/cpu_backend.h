// CpuBackend: the reference backend. KV pools in host memory, the CPU
// reference kernels of kernels/, always built.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"

namespace attnserve {

class CpuBackend final : public Backend {
 public:
  // Allocates and zeroes the K and V pools (geometry.PoolBytes() each).
  static absl::StatusOr<std::unique_ptr<Backend>> Create(const KvGeometry& geometry);

  std::string Name() const override { return "cpu"; }
  std::string Device() const override;
  const KvGeometry& Geometry() const override { return geo_; }

  // The CPU computes the batch in Submit; Complete hands back its status.
  absl::Status Submit(absl::Span<const PrefillTask> tasks, BatchStats* stats) override;
  absl::Status Complete(BatchStats* stats) override;
  absl::Status WriteKv(const KvRows& rows, BatchStats* stats) override;
  absl::Status ReadKv(const KvRows& rows, BatchStats* stats) override;
  // A memset of each page's rows in each layer.
  absl::Status ZeroPages(absl::Span<const int32_t> pages, BatchStats* stats) override;
  absl::Status SetKvScales(int32_t layer, absl::Span<const float> k_scales,
                           absl::Span<const float> v_scales) override;
  // System regions are used as they are; CUDA regions are refused
  // (FAILED_PRECONDITION naming this backend).
  RegionDevice* region_device() override { return &region_device_; }

 private:
  class CpuRegionDevice final : public RegionDevice {
   public:
    absl::StatusOr<void*> OpenIpc(absl::string_view, int32_t, int64_t) override {
      return absl::FailedPreconditionError(
          "cuda regions need the cuda backend: this server runs the cpu backend, which cannot "
          "open CUDA IPC handles (start it with --backend=cuda on a GPU host)");
    }
  };

  explicit CpuBackend(const KvGeometry& geometry) : geo_(geometry) {}
  // Scatters n rows (k, v: (n, num_kv_heads, head_dim), each contiguous or
  // in pieces; FP8 bytes when rows_fp8, else geo.dtype values) into `layer`
  // by slot.
  void Append(int32_t layer, const int64_t* slots, int64_t n, const void* k,
              const ScatterList& k_scattered, const void* v, const ScatterList& v_scattered,
              bool rows_fp8);
  // Attention of one task into its o and lse, stopped where its caller
  // gives up (PrefillTask::given_up). False: it stopped, or never began.
  bool Attend(const PrefillTask& t);

  KvGeometry geo_;
  bool pending_ = false;     // a batch was submitted and not completed
  BatchStats pending_stats_;
  std::vector<uint8_t> k_pool_;  // geo_.PoolBytes() each
  std::vector<uint8_t> v_pool_;
  // FP8 pools: (num_layers, num_kv_heads) scales, 1.0 until SetKvScales.
  std::vector<float> k_scales_;
  std::vector<float> v_scales_;
  CpuRegionDevice region_device_;
};

}  // namespace attnserve
