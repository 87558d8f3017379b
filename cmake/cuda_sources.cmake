# Sources of the CUDA kernels and the CUDA backend (built with ATTNSERVE_CUDA).
set(ATTNSERVE_CUDA_SOURCES
  kernels/paged_prefill.cu
  kernels/merge_states.cu
  kernels/append_kv.cu
  kernels/decode/decode_cuda.cu)
set(ATTNSERVE_CUDA_BACKEND_SOURCES
  server/cuda_backend.cc)
