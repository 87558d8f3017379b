source .gpu/common.sh
D=decode_b64,decode_b64_e4m3,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3,spec_b64_q4_e4m3
for pass in a b; do st decode_$pass 90 $I/bin/attnserve_decode_bench --quick --only=$D; done
for pass in a b; do echo "== $pass"; grep "kernel=decode workload" $O/l/decode_$pass.log | awk '{print $3,$4,$8,$9,$10}'; done
W="--quick --workload=long,batch,prefix --page_sizes=1,16"
st fp8 60 $I/bin/attnserve_kernel_bench $W --kv_dtype=fp8_e4m3
st bf16 60 $I/bin/attnserve_kernel_bench $W
for f in fp8 bf16; do echo "== $f"; grep "RESULT kernel=prefill" $O/l/$f.log | awk '{print $3,$8,$11,$12}' | tr '\n' ';'; echo; done
st fp8_tests 200 $I/bin/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda*'
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED" $O/l/fp8_tests.log | head -5
st decode_tests 90 $I/bin/attnserve_gpu_decode_tests
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED" $O/l/decode_tests.log | head -5
cat $O/l/summary.txt
fin
