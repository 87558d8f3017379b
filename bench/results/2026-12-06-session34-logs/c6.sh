# s34 c6: the rest of session 33's c3 (HEAD's host code with a CUDA server) not reached by c5.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
ATTNSERVE_BIN=$B/attnserve st py_fp8 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
ATTNSERVE_BIN=$B/attnserve ATTNSERVE_TEST_BACKEND=cuda st py_edge 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_edge_bounds.py -k "not_read or plans_hold"
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 60 $B/attnserve_gpu_region_tests
st torch 120 python3 bench/torch_baselines.py --quick
st kt_backend 150 $B/attnserve_gpu_kernel_tests --gtest_filter='CudaBackend*:Fp8CudaBackend*'
fin
