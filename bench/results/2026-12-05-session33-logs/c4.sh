# s33 c4: c3 cut to the device time left (~370 s): e2's FP8 tests and the HEAD/e2 A/B first, then the
# server-level GPU tests and the FlashInfer FP8 / CUDA pytest files against a CUDA server (2a8e51d).
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
st kt_e2 90 $B/kt_e2 --gtest_filter='Fp8Cuda*'
for p in a b; do
  st kb8_$p 40 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st kb8e2_$p 40 $B/kb_e2 --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
done
st kb16_a 40 $B/attnserve_kernel_bench --quick --workload=$W --page_sizes=1,16
ATTNSERVE_BIN=$B/attnserve st py_fp8 60 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 80 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
fin
