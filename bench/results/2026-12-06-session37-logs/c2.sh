# s37 c2: the final code's kernels and host code. The new FP8 test (tiny queries at tiny scales: the
# FP8 prefill multiplier x 2^-e underflowed to 0 and a masked key made the causal rows NaN) on the kernels
# of HEAD before the fix (kt_old: the new test binary linked with the old kernel library) and on the
# fix; the decode and whole kernel suites; the server-level GPU tests and the FlashInfer FP8 pytest
# against a CUDA server (the scale bounds and messages changed); FP8 and bf16 sm90_overlap prefill,
# the fix (new) against HEAD's kernels (kb_l000), two passes alternating.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
st kt_old_tiny 60 $B/kt_old --gtest_filter='Fp8Cuda.TinyScales*'
st kt_new_tiny 60 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda.TinyScales*'
PW=long,batch,prefix,sweep_len512
for p in a b; do
  for v in old new; do
    k=$B/attnserve_kernel_bench; [ $v = old ] && k=$B/kb_l000
    st kb8_${v}_$p 60 $k --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
    st kb16_${v}_$p 60 $k --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16
  done
done
st decode_tests 150 $B/attnserve_gpu_decode_tests
st kernel_tests 300 $B/attnserve_gpu_kernel_tests
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 170 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
ATTNSERVE_BIN=$B/attnserve st py_fp8 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
grep -h "PASSED\|FAILED\|passed\|failed" $O/l/kt_old_tiny.log $O/l/kt_new_tiny.log $O/l/decode_tests.log $O/l/kernel_tests.log $O/l/py_fp8.log | tail -14
tail -3 $O/l/server.log
fin
