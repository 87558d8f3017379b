// The sm90 paged prefill kernel: wgmma with a warp-specialized producer.
//
// 3 warpgroups per CTA; one work item per CTA (Schedule::kSerial) or, for
// the overlapped schedule, a persistent CTA per SM looping over the plan's
// items (ForEachTile; Traits::kPersistent):
//  - warpgroup 0 (producer, registers lowered by setmaxnreg) gathers the Q
//    tile and K/V blocks of kKB rows with cp.async into rings of kKStages
//    K and kVStages V stages; page_size 1 gathers arbitrary rows, which the
//    tensor copy engine cannot. Each thread owns one KV row's page-table
//    lookup per block,
//    loaded one block ahead, and eight lanes copy each 128-byte line. In the
//    serial schedule a group of copies is complete when cp.async waits for
//    it; the thread then fences to the async proxy and arrives on the
//    stage's mbarrier. In the overlapped one each stage's barrier tracks the
//    copies (cp.async.mbarrier.arrive.noinc; K and V apart, so S = Q K^T
//    starts before V lands) and, with Traits::kTma (pages of 8 rows or
//    more), whole blocks come by the tensor copy engine instead, one
//    128-byte swizzled box per run of rows within a page and column block;
//    the block's bytes complete the stage's barrier.
//  - warpgroups 1 and 2 (consumers, registers raised) each own 64 packed
//    query rows: S = Q K^T by wgmma with both operands in shared memory
//    (K-major), the boundary mask, the lazy online softmax in base 2, and
//    O += P V by wgmma with P in registers and V in shared memory (MN-major);
//    then they release the stage (empty mbarrier). The two take turns to
//    issue S (ping-pong, named barriers) so one's softmax overlaps the other's
//    GEMMs. Traits::kOverlap (PagedPrefillSm90OverlapKernel) pipelines each
//    warpgroup instead: turn t issues S_t and P_{t-1} V_{t-1}, then computes
//    softmax(S_t) while P_{t-1} V_{t-1} runs (traits.cuh, Schedule). Q has
//    two buffers there: the producer loads the next tile's Q as it starts a
//    tile (a Q load takes longer than a tile's last turn and epilogue), and
//    the consumers release a buffer (q_empty) after their last S of its
//    tile. Their turns run on across tiles, so that warpgroup 0 starts the
//    next tile while warpgroup 1 finishes this one.
// Per-tile index arithmetic divides by launch constants (FastDiv), and each
// tile's descriptor is read while the last one's epilogue runs.
// The epilogue normalises and writes either the final o / lse (16-byte
// chunks after a transpose within each quad) or, for a split item, an fp32
// partial state for the merge family, as kernels/sm80.
// Traits::kFp8 (PagedPrefillSm90OverlapKernel's kFp8, kernels/sm90/
// prefill_fp8.cu): on FP8 pools the producer lands each block's FP8 rows in
// the upper half of its stage and converts the stage in place to fp16
// (kernels/sm90/fp8_tiles.cuh) before it completes the full barrier; bf16 Q
// tiles are carried into fp16 per row; both GEMMs run in fp16.
// kTrace (PagedPrefillSm90Traced) adds clock64 stamps of each phase
// (Sm90Trace); the server's kernels have none.
//
// This file holds the CTA (barrier setup, then the split into roles) and
// the kernels; each role's code is in its own header, ProducerRole in
// producer.cuh and ConsumerRole in consumer.cuh, and what both read (the
// item as a CTA runs it, ForEachTile, CtaSmem) in cta.cuh.
//
// Semantics are those of kernels/paged_prefill.h, written once in
// kernels/variant.h (GQA packing, causal with causal_shift, windows,
// soft-cap, sinks, empty rows -> 0 and -inf or the sink, base-2 LSE).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/sm90/consumer.cuh"
#include "kernels/sm90/cta.cuh"
#include "kernels/sm90/producer.cuh"
#include "kernels/sm90/traits.cuh"

namespace attnserve {
namespace sm90 {

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNSERVE_SM90_DEVICE 1
#else
#define ATTNSERVE_SM90_DEVICE 0
#endif

// One CTA's work items (the body of both kernels below; sm_90a only).
template <typename Tr, typename T, bool kTrace = false>
__device__ __forceinline__ void PrefillCta(const PrefillKernelArgs& args) {
  constexpr int SK = Tr::kKStages;
  constexpr int SV = Tr::kVStages;
  constexpr int QB = Tr::kQBufs;
  extern __shared__ uint8_t smem_raw[];
  const CtaSmem<Tr> cs = CtaSmem<Tr>::Of(smem_raw);
  const int tid = threadIdx.x;
  const int wg = tid >> 7;  // 0 producer, 1..2 consumers

  if (tid == 0) {
    for (int qb = 0; qb < QB; ++qb) {
      MbarInit(cs.bar_q(qb), 128);
      if (Tr::kPersistent) MbarInit(cs.bar_q_empty(qb), 256);
    }
    for (int s = 0; s < SK; ++s) {
      MbarInit(cs.bar_k(s), 128);
      MbarInit(cs.bar_k_empty(s), 256);
    }
    for (int s = 0; s < SV; ++s) {
      MbarInit(cs.bar_v(s), 128);
      if (Tr::kSplitEmpty) MbarInit(cs.bar_v_empty(s), 256);
    }
    if constexpr (Tr::kFp8) {
      for (int s = 0; s < SK; ++s) MbarInit(cs.bar_k_land(s), 128);
      for (int s = 0; s < SV; ++s) MbarInit(cs.bar_v_land(s), 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // setmaxnreg in each role's own branch: ptxas honours it only where it
  // dominates code of that role alone (C7507 otherwise).
  if (wg == 0) {
    ProducerRole<Tr, T, kTrace>(args, cs, tid);
    return;
  }
  if constexpr (Tr::kFp8) {
    if (wg == 3) {
      ConverterRole<Tr>(args, cs, tid - 384);
      return;
    }
  }
  ConsumerRole<Tr, T, kTrace>(args, cs, tid, wg);
}

#if ATTNSERVE_SM90_DEVICE
#define ATTNSERVE_SM90_BODY(...) PrefillCta<__VA_ARGS__>(args)
#else
// Built for another architecture: the launch refuses devices other than
// sm_90 (PagedPrefillSm90), so this body never runs.
#define ATTNSERVE_SM90_BODY(...) __trap()
#endif

// The serial schedule (PrefillKernel::kSm90).
template <int D, typename T>
__global__ void __launch_bounds__(384, 1) PagedPrefillSm90Kernel(const __grid_constant__ PrefillKernelArgs args) {
  ATTNSERVE_SM90_BODY(Traits<D, Schedule::kSerial, true>, T);
}

// The overlapped schedule, with or without turns between the consumer
// warpgroups (PrefillKernel::kSm90Overlap, kSm90OverlapNoPp); kTrace: with
// clock64 stamps (PagedPrefillSm90Traced).
// kTma: K and V by the tensor copy engine (Traits); the tensor maps are read
// from the kernel's parameter space (__grid_constant__).
// kSoftCap, kSinks: with soft-caps, sinks (Traits).
// kFp8: on FP8 pools (Traits::kFp8; T is the queries' and outputs' type);
// kFp8Q: with S = Q K^T in FP8 on K stored in that format (Traits::kFp8Q).
template <int D, typename T, bool kPingPong, bool kTrace = false, bool kTma = false, bool kSoftCap = true,
          bool kSinks = true, bool kFp8 = false, Fp8Format kFp8Q = Fp8Format::kNone>
__global__ void __launch_bounds__(kFp8 ? 512 : 384, 1)
    PagedPrefillSm90OverlapKernel(const __grid_constant__ PrefillKernelArgs args) {
  ATTNSERVE_SM90_BODY(Traits<D, Schedule::kOverlap, kPingPong, kTma, kSoftCap, kSinks, kFp8, kFp8Q>, T, kTrace);
}

#undef ATTNSERVE_SM90_BODY

}  // namespace sm90
}  // namespace attnserve
