# s30 c4: the final tree (sequences without query rows left out of a Prefill's task, written-rows marks before
# the unpin): server-level GPU tests, the CUDA backend and FP8 GPU tests, the CUDA-region suite, and the
# FlashInfer FP8 and CUDA pytest files against a CUDA-built server.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
st kt_backend 120 $B/attnserve_gpu_kernel_tests --gtest_filter='CudaBackend*:Fp8CudaBackend*'
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 90 $B/attnserve_gpu_region_tests
ATTNSERVE_BIN=$B/attnserve st py_fp8 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 150 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
fin
