# s32 c2: the session's final host code (0262819 and after: response bytes held until sent, wire limits on
# unlisted fields, metrics shapes, startup checks) with a CUDA backend: the server-level GPU tests, the CUDA
# backend tests, the CUDA-region suite, and the FlashInfer FP8 and CUDA pytest files against a CUDA-built server.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
git log -1 --format=%H 2>/dev/null | tee -a $O/l/device.txt
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 200 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
st kt_backend 150 $B/attnserve_gpu_kernel_tests --gtest_filter='CudaBackend*:Fp8CudaBackend*'
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 90 $B/attnserve_gpu_region_tests
ATTNSERVE_BIN=$B/attnserve st py_fp8 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 150 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
ATTNSERVE_BIN=$B/attnserve ATTNSERVE_TEST_BACKEND=cuda st py_edge 200 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_edge_bounds.py -k "not_read or plans_hold"
fin
