# s35 c5: the session's host code on a GPU (HEAD): the server-level GPU tests, the FlashInfer FP8 and CUDA
# pytest files and the request-channel tests against a CUDA server, the CUDA-region suite, the CUDA
# backend tests and the decode suite.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
ATTNSERVE_BIN=$B/attnserve st py_fp8 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve ATTNSERVE_TEST_BACKEND=cuda st py_channel 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_channel.py
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 60 $B/attnserve_gpu_region_tests
st kt_backend 150 $B/attnserve_gpu_kernel_tests --gtest_filter='CudaBackend*:Fp8CudaBackend*'
st decode_tests 90 $B/attnserve_gpu_decode_tests
st server 200 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
fin
