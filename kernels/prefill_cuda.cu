// The one switch from PrefillKernel to a family's entry points.
#include "kernels/prefill_cuda.h"

#include "kernels/sm80/prefill_sm80.h"
#include "kernels/sm90/prefill_sm90.h"

namespace attnserve {

cudaError_t PagedPrefillCuda(const PagedPrefillParams& params, const PrefillWorkItem* items,
                             int32_t num_items, float* part_o, float* part_lse,
                             PrefillKernel kernel, cudaStream_t stream) {
  switch (kernel) {
    case PrefillKernel::kSm80:
    case PrefillKernel::kSm80Rows64:
      return PagedPrefillSm80(params, items, num_items, part_o, part_lse,
                              kernel == PrefillKernel::kSm80Rows64, stream);
    case PrefillKernel::kSm90:
      return PagedPrefillSm90(params, items, num_items, part_o, part_lse, Sm90Variant::kSerial, stream);
    case PrefillKernel::kSm90Overlap:
      return PagedPrefillSm90(params, items, num_items, part_o, part_lse, Sm90Variant::kOverlap, stream);
    case PrefillKernel::kSm90OverlapNoPp:
      return PagedPrefillSm90(params, items, num_items, part_o, part_lse, Sm90Variant::kOverlapNoPingPong,
                              stream);
    case PrefillKernel::kSm90Fp8Q:
      return PagedPrefillSm90(params, items, num_items, part_o, part_lse, Sm90Variant::kOverlapFp8Q, stream);
  }
  return cudaErrorInvalidValue;
}

int32_t PrefillCtasPerSm(PrefillKernel kernel, int32_t head_dim, KvDType dtype, Fp8Format kv_fp8) {
  switch (kernel) {
    case PrefillKernel::kSm80:
    case PrefillKernel::kSm80Rows64:
      return Sm80PrefillCtasPerSm(head_dim, dtype, kernel == PrefillKernel::kSm80Rows64, kv_fp8);
    case PrefillKernel::kSm90:
      return Sm90PrefillCtasPerSm(head_dim, dtype, Sm90Variant::kSerial);
    case PrefillKernel::kSm90Overlap:
      return Sm90PrefillCtasPerSm(head_dim, dtype, Sm90Variant::kOverlap);
    case PrefillKernel::kSm90OverlapNoPp:
      return Sm90PrefillCtasPerSm(head_dim, dtype, Sm90Variant::kOverlapNoPingPong);
    case PrefillKernel::kSm90Fp8Q:
      return Sm90PrefillCtasPerSm(head_dim, dtype, Sm90Variant::kOverlapFp8Q);
  }
  return 1;
}

}  // namespace attnserve
