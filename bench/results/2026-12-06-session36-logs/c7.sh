# s36 c7: the final host and kernel code on a GPU: the decode suite and the whole kernel suite (every
# plan run twice, the same bits), the server-level GPU tests (bench/run_server_gpu.sh, the relocatable
# install), the CUDA-region suite, and the CUDA FlashInfer pytest file against a CUDA server.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
st decode_tests 150 $B/attnserve_gpu_decode_tests
st kernel_tests 300 $B/attnserve_gpu_kernel_tests
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 170 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 60 $B/attnserve_gpu_region_tests
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
grep -h "PASSED\|FAILED\|SKIPPED\|passed\|failed" $O/l/decode_tests.log $O/l/kernel_tests.log $O/l/region_tests.log $O/l/py_fi_cuda.log | tail -12
tail -3 $O/l/server.log
fin
