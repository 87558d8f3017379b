#include "server/backend/factory.h"

#include "absl/strings/str_cat.h"
#include "server/backend/cpu/cpu_backend.h"
#if defined(ATTNSERVE_WITH_CUDA)
#include "server/backend/cuda/cuda_backend.h"
#endif

namespace attnserve {

bool CudaDevicePresent() {
#if defined(ATTNSERVE_WITH_CUDA)
  return CudaDeviceCount() > 0;
#else
  return false;
#endif
}

int64_t BytesPerPage(const KvGeometry& geo) {
  return int64_t{geo.NumPools()} * geo.num_layers * geo.page_size * geo.KvRowBytes();
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const BackendOptions& options) {
  std::string kind = options.kind;
  if (kind == "auto") kind = CudaDevicePresent() ? "cuda" : "cpu";
  if (kind == "cpu") return CpuBackend::Create(options.geometry);
  if (kind == "cuda") {
#if defined(ATTNSERVE_WITH_CUDA)
    return MakeCudaBackend(options);
#else
    return absl::UnimplementedError(
        "--backend=cuda: this build has no CUDA backend (configure with -DATTNSERVE_CUDA=ON)");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--backend=", options.kind, " must be auto, cuda or cpu"));
}

}  // namespace attnserve
