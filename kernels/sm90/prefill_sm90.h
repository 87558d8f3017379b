// The Hopper (sm_90a) paged prefill family: wgmma, a cp.async producer
// warpgroup feeding two consumer warpgroups through mbarriers. head_dim 64
// and 128; 128-row tiles (PrefillTileRows for PrefillKernel::kSm90,
// kSm90Overlap and kSm90OverlapNoPp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/kv_geometry.h"
#include "kernels/paged_prefill.h"
#include "kernels/plan/prefill_plan.h"

namespace attnserve {

// The consumer warpgroups' schedule (kernels/sm90/traits.cuh, Schedule):
// kSerial is PrefillKernel::kSm90; kOverlap (intra-warpgroup overlap and
// turns over both GEMMs) kSm90Overlap; kOverlapNoPingPong (the overlap
// alone) kSm90OverlapNoPp; kOverlapFp8Q (kOverlap with S = Q K^T in FP8, on
// FP8 pools at head_dim 128, else cudaErrorInvalidValue) kSm90Fp8Q.
enum class Sm90Variant : int32_t { kSerial, kOverlap, kOverlapNoPingPong, kOverlapFp8Q };

// Runs every work item as PagedPrefillCuda documents (the overlapped
// variants on a persistent grid of one CTA per SM, at most params.max_ctas).
// cudaErrorNotSupported on a device that is not compute capability 9.0 (the
// family is built only for sm_90a); cudaErrorInvalidValue for a head_dim
// other than 64 or 128.
cudaError_t PagedPrefillSm90(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse, Sm90Variant variant,
                             cudaStream_t stream);

// Resident CTAs per SM of the kernel on the current device (1 where it runs).
int32_t Sm90PrefillCtasPerSm(int32_t head_dim, KvDType dtype, Sm90Variant variant);

// Whether the current device runs this family (compute capability 9.x).
bool Sm90PrefillSupported();

// Diagnostics: where a CTA's time goes. PagedPrefillSm90Traced runs
// Sm90Variant::kOverlap (bf16 queries, head_dim 128, without soft-caps and
// sinks; bf16 or FP8 pools) with clock64() stamps (SM
// cycles) of the first tile of the first `trace_ctas` CTAs (at most one per
// SM: the kernel is persistent) written to `trace` (device
// memory, trace_ctas * kLongsPerCta values, zeroed by the caller): per CTA a
// header, the producer's stamps per KV block and each consumer warpgroup's
// stamps per turn, for the first kTurns blocks / turns, and consumer
// warpgroup 0's stamps per tile for the first kTiles tiles (bench/kernel_bench.cc
// --trace reads them). The traced kernel is a separate instantiation: the
// server's never stamps.
struct Sm90Trace {
  static constexpr int kTurns = 128;
  // Header: 0 SM id, 1 CTA start (after the barrier set-up), 2 / 3 the end
  // of consumer warpgroup 0 / 1's epilogue, 4 KV blocks of the tile, 5 / 6
  // blocks consumer warpgroup 0 / 1 computes.
  static constexpr int kHeader = 8;
  // Producer, per block b: 0 start, 1 slots shared, 2 K stage free, 3 K
  // issued, 4 V stage free, 5 V issued.
  static constexpr int kProducerPoints = 6;
  // Consumer, per turn t: 0 start, 1 K_t and V_{t-1} landed, 2 turn taken,
  // 3 GEMMs issued, 4 S_t complete, 5 softmax done, 6 P_{t-1} V_{t-1}
  // complete, 7 O rescaled and P_t packed.
  static constexpr int kConsumerPoints = 8;
  static constexpr int kProducerAt = kHeader;
  static constexpr int ConsumerAt(int cw) { return kProducerAt + kTurns * kProducerPoints + cw * (kTurns + 1) * kConsumerPoints; }
  // Per tile of the CTA (the first kTiles), consumer warpgroup 0: 0 start,
  // 1 Q landed, 2 K_0 landed and the first turn taken, 3 last turn done,
  // 4 epilogue done, 5 the tile's KV blocks (a count, not a stamp), 10 the
  // epilogue's row sums and LSE done (before the stores); the producer: 6
  // start, 7 Q issued, 8 K_0 issued; consumer warpgroup 1: 11 last turn
  // done, 9 epilogue done; consumer warpgroup 0: 12 Q landed, before its
  // rows' conversion (FP8 pools with bf16 queries; 1 is after it).
  static constexpr int kTiles = 96;
  static constexpr int kTilePoints = 13;
  static constexpr int kTileAt = kProducerAt + kTurns * kProducerPoints + 2 * (kTurns + 1) * kConsumerPoints;
  static constexpr int kLongsPerCta = kTileAt + kTiles * kTilePoints;
};

cudaError_t PagedPrefillSm90Traced(const PagedPrefillParams& params, const PrefillWorkItem* items,
                                   int32_t num_items, float* part_o, float* part_lse, long long* trace,
                                   int32_t trace_ctas, cudaStream_t stream);

}  // namespace attnserve
