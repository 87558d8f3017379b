// Which prefill kernel runs a batch: the named kernels of every family, their
// tile shapes, and the heuristic that picks one per batch. Plain C++ (no
// CUDA), unit-tested in tests/kernels/kernel_select_test.cc.
//
// A family is a folder under kernels/ (kernels/sm80/, kernels/sm90/). Adding one is a
// new enum value here, its tile rows in PrefillTileRows, one line in
// ChoosePrefillKernel, and one case in kernels/prefill_cuda.cu's dispatch
// (docs/design.md section 2.4).
#pragma once

#include <cstdint>

#include "common/kv_geometry.h"

namespace attnserve {

enum class PrefillKernel : int32_t {
  // mma.sync (sm_80+), the widest tile head_dim allows: 128 packed query rows
  // (two 16-row MMA tiles per warp) at head_dim 64 and 128, 64 at 256.
  kSm80,
  // mma.sync, 64-row tiles (one MMA tile per warp) at head_dim 128: for
  // batches whose every sequence packs at most 64 rows (decode-sized), where
  // a 128-row tile would be half empty.
  kSm80Rows64,
  // wgmma (sm_90a only, kernels/sm90/): a cp.async producer warpgroup and two
  // consumer warpgroups of 64 rows, 128-row tiles, head_dim 64 and 128.
  kSm90,
  // The same family, each consumer warpgroup software-pipelined (S of the
  // next KV block and P V of the last one issued together, the softmax
  // beside the P V GEMM) and the two warpgroups taking turns over both
  // GEMMs (kernels/sm90/traits.cuh, Schedule::kOverlap). The family's
  // kernel in the server (--prefill_kernel=sm90, and auto on long KV
  // ranges); kSm90 stays for the kernel bench and the GPU tests.
  kSm90Overlap,
  // kSm90Overlap without the turns between the warpgroups.
  kSm90OverlapNoPp,
  // kSm90Overlap on FP8 pools (E4M3 or E5M2) at head_dim 128 with S = Q K^T
  // in FP8: each query row rounded to E4M3 times a power of two, K's stored
  // bytes read as they are (Traits::kFp8Q). Opt-in (--prefill_kernel=sm90_fp8q): the
  // queries' rounding is its own error.
  kSm90Fp8Q,
};
inline constexpr int kNumPrefillKernels = 6;

// Whether the kernel is one of the wgmma family's (sm_90 devices only).
inline bool IsSm90Kernel(PrefillKernel kernel) {
  return kernel == PrefillKernel::kSm90 || kernel == PrefillKernel::kSm90Overlap ||
         kernel == PrefillKernel::kSm90OverlapNoPp || kernel == PrefillKernel::kSm90Fp8Q;
}

// CTAs of a persistent kernel's grid, which loop over the plan's items
// (PrefillPlanOptions::persistent_ctas): one wave, num_sms * ctas_per_sm,
// for the wgmma family's overlapped kernels; 0 for kernels that run one CTA
// per item.
inline int32_t PrefillPersistentCtas(PrefillKernel kernel, int32_t num_sms, int32_t ctas_per_sm) {
  const bool persistent = kernel == PrefillKernel::kSm90Overlap || kernel == PrefillKernel::kSm90OverlapNoPp ||
                          kernel == PrefillKernel::kSm90Fp8Q;
  return persistent ? (num_sms > 0 ? num_sms : 1) * (ctas_per_sm > 0 ? ctas_per_sm : 1) : 0;
}

// Stable lower-case name, used in metrics (the `family` label) and in
// benchmark output: "sm80", "sm80_rows64", "sm90", "sm90_overlap",
// "sm90_overlap_nopp", "sm90_fp8q".
const char* PrefillKernelName(PrefillKernel kernel);

// Packed query rows per tile (the plan's tile_rows).
int32_t PrefillTileRows(PrefillKernel kernel, int32_t head_dim);

// What the heuristic knows about the device.
struct PrefillDevice {
  int32_t sm_major = 8;  // compute capability
  int32_t sm_minor = 0;
};

// Which families the heuristic may pick from (the server's
// --prefill_kernel=auto|sm80|sm90|sm90_fp8q).
enum class PrefillFamily : int32_t {
  kAuto,  // the heuristic's choice for the device
  kSm80,  // the mma.sync family only (kSm80 or kSm80Rows64)
  kSm90,  // the wgmma family (kSm90Overlap) wherever it runs the head_dim
          // (64, 128); head_dim 256 stays on kSm80
  kSm90Fp8Q,  // kSm90Fp8Q for every prefill batch; only on FP8 pools at
              // head_dim 128 (PrefillFamilyFitsGeometry)
};

// "auto" / "sm80" / "sm90" / "sm90_fp8q" -> *family; false for any other
// text.
bool ParsePrefillFamily(const char* text, PrefillFamily* family);
const char* PrefillFamilyName(PrefillFamily family);

// Whether the family's kernels run on the device: kSm90 needs compute
// capability 9.x (sm_90a code only).
bool PrefillFamilyRunsOn(PrefillFamily family, const PrefillDevice& device);

// Whether the family runs a cache of this geometry: kSm90Fp8Q needs FP8
// pools (E4M3 or E5M2) at head_dim 128 (every other family runs every geometry, on the
// kernels ChoosePrefillKernel picks). When false, *why says which field
// and what it must be.
bool PrefillFamilyFitsGeometry(PrefillFamily family, const KvGeometry& geo, const char** why);

// Smallest mean KV length per query row (keys, sum(q_len * kv_len) /
// sum(q_len) over the batch's prefill sequences) at which kAuto picks
// kSm90Overlap on Hopper. From the H200 run of 2026-12-01 with the
// persistent overlapped kernel (bench/results/2026-12-01-session7-h200.md,
// page_size 1): causal 16k / n sequences of n keys, sm90_overlap / sm80
// TFLOP/s: n = 512 232 / 207, 1024 327 / 259, 2048 424 / 298, 4096 502 /
// 323, 16k 571 / 349; prefix 32 x 512 over 4096: 521 / 334. Shorter
// ranges, in the same call (bench/results/2026-12-05-session30-h200.md,
// page_size 1 / 16): n = 256 191 / 180 against 138 / 139, n = 128 110 / 101
// against 87 / 88. Below 128 keys it was not measured and stays on sm80.
inline constexpr int64_t kAutoSm90MinMeanKv = 128;

// Smallest mean KV length per query row (as for kAutoSm90MinMeanKv) at which
// the sm90 family loads pages of 8 rows or more by the tensor copy engine on
// 16-bit pools; below it, by cp.async as at page_size 1. On short sequences
// the tensor copies lost: an H100, same-call A/B, bf16, causal 16k / n
// sequences of n keys, cp.async against tensor copies at page_size 16 / 64:
// n = 256 +8.1% / +6.5%, 512 +6.9% / +2.6%, 1024 +3.3% / 0.0%, 2048 -1.7% /
// -2.4%, 4096 -3.1% / -3.9%; `batch`, `prefix` and `long` -0.7 to -5.1%
// (bench/results/2026-12-07-session44-h100.md, c8; with this rule, c9:
// +7.8 / +5.1% at 256 keys, +8.5 / +3.4% at 512, +2.9 / +0.3% at 1024, the
// longer workloads on the same kernel as before). The two loads give the
// same bits (PagedPrefillCuda.TensorCopiesAndCpAsyncBothMatch). FP8 pools
// keep the tensor copies at every length (cp.async within 1% below 2k keys,
// behind above).
inline constexpr int64_t kSm90TensorCopyMinMeanKv = 1536;

// Whether the sm90 family may load this batch's pages by the tensor copy
// engine (PagedPrefillParams::mean_kv_per_row; 0: not given, yes).
inline bool Sm90TensorCopies(const KvGeometry& geo, int64_t mean_kv_per_row) {
  return geo.KvIsFp8() || mean_kv_per_row <= 0 || mean_kv_per_row >= kSm90TensorCopyMinMeanKv;
}

// The kernel for a batch whose longest sequence packs max_packed_rows rows
// (q_len * num_qo_heads / num_kv_heads) and whose query rows see
// mean_kv_per_row keys on average (as for kAutoSm90MinMeanKv), among the
// family's kernels. Every kernel it picks (kSm80, kSm80Rows64,
// kSm90Overlap) reads FP8 pools too (kSm90 and kSm90OverlapNoPp, which only
// the kernel bench and the GPU tests run, read 16-bit pools alone); FP8
// pools choose as 16-bit pools do, but on Hopper under kAuto they take
// kSm90Overlap whatever the lengths (at head_dim 64 and 128): on the H200
// its FP8 kernel ran 1.3-1.4x the sm80 family's on sequences of 128 and
// 256 keys, 1.5x at 512 and 1.65-1.9x at 2k-16k (bench/results/
// 2026-12-04-session27-h200.md; the sm80 family converts each K and V
// block, and bf16 Q tiles, with the threads that run the MMAs).
PrefillKernel ChoosePrefillKernel(const KvGeometry& geo, const PrefillDevice& device,
                                  int64_t max_packed_rows,
                                  PrefillFamily family = PrefillFamily::kAuto, int64_t mean_kv_per_row = 0);

}  // namespace attnserve
