source .gpu/common.sh
st fp8_tests 90 $I/bin/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda*'
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED" $O/l/fp8_tests.log | head -8
st decode_tests 40 $I/bin/attnserve_gpu_decode_tests
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED" $O/l/decode_tests.log | head -4
st fp8 30 $I/bin/attnserve_kernel_bench --quick --workload=long,batch,prefix --page_sizes=1,16 --kv_dtype=fp8_e4m3
grep "RESULT kernel=prefill" $O/l/fp8.log | awk '{print $3,$8,$12}' | tr '\n' ';'; echo
D=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3
st dec_new 30 $I/bin/attnserve_decode_bench --quick --only=$D
st dec_prev 30 $I/bin/attnserve_decode_bench_prev --quick --only=$D
for f in dec_new dec_prev; do echo "== $f"; grep "kernel=decode workload" $O/l/$f.log | awk '{print $3,$8,$9}' | tr '\n' ';'; echo; done
cat $O/l/summary.txt
fin
