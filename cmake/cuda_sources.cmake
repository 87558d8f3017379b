# Sources of the CUDA kernel families and the CUDA backend (built with
# ATTNSERVE_CUDA). One line per family folder.
set(ATTNSERVE_CUDA_SOURCES
  kernels/prefill_cuda.cu
  kernels/sm80/prefill.cu
  kernels/sm80/prefill_fp8.cu
  kernels/sm90/prefill.cu
  kernels/sm90/prefill_fp8.cu
  kernels/sm90/prefill_fp8q.cu
  kernels/merge/merge.cu
  kernels/kv/kv_rows.cu
  kernels/decode/decode_cuda.cu
  kernels/mla/mla.cu
  kernels/mla/mla_sm90.cu)
set(ATTNSERVE_CUDA_BACKEND_SOURCES
  server/backend/cuda/cuda_backend.cc
  server/backend/cuda/cuda_backend_kv.cc
  server/backend/cuda/cuda_region_device.cc
  server/backend/cuda/attention_launch.cc
  server/backend/cuda/staging_ring.cc
  server/backend/cuda/cuda_util.cc)
