# s34 c7: c5 cut down to the device time left late in the session: the A/B of HEAD against e2, e3 and e23
# (one pass at page_size 16 and 64, then a second), e23's FP8 kernel tests, traces of HEAD and e3, the
# FlashInfer FP8 and CUDA pytest files and the server-level GPU tests against a CUDA server.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
for p in a b; do
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  for v in e2 e3 e23; do
    st kb8${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  done
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --workload=$W --page_sizes=1,16
done
st kt_e23 150 $B/kt_e23 --gtest_filter='Fp8Cuda*'
st trace8h 45 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long,batch --page_sizes=16 --kv_dtype=fp8_e4m3 --trace=132
st trace8e3 45 $B/kb_e3 --quick --kernel=sm90_overlap --workload=long,batch --page_sizes=16 --kv_dtype=fp8_e4m3 --trace=132
ATTNSERVE_BIN=$B/attnserve st py_fp8 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
fin
