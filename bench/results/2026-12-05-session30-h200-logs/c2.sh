# s30 c2: HEAD's install: the server-level GPU tests, the CUDA-region tests (the server at the test's build path),
# the FlashInfer FP8 and CUDA pytest files under the machine's torch, ncu of sm90_overlap `long` bf16 vs FP8.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 90 $B/attnserve_gpu_region_tests
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
ATTNSERVE_BIN=$B/attnserve st py_fp8 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 150 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
for k in bf16 fp8_e4m3; do
  st ncu_$k 90 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section WarpStateStats -k regex:PagedPrefillSm90OverlapKernel --launch-count 1 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long --page_sizes=16 --kv_dtype=$k
done
fin
