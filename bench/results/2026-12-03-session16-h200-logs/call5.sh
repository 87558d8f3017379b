source .gpu/common.sh
st fp8_tests 200 $I/bin/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda*:VariantsCuda*'
grep -E "^\[  (PASSED|FAILED) |Failure|error:|round" $O/l/fp8_tests.log | head -20
st decode_tests 120 $I/bin/attnserve_gpu_decode_tests
grep -E "^\[  (PASSED|FAILED) |Failure" $O/l/decode_tests.log | head -10
W=decode_b64,decode_b64_e4m3,decode_b64_e5m2,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3,decode_b64_cap,decode_b64_sink,decode_b1,decode_b1_e4m3,spec_b64_q4,spec_b64_q4_e4m3,win128_b64_32k,decode_b64_128
for pass in a b; do
  st bench_base_$pass 120 $I/bin/attnserve_decode_bench_base --quick --only=$W
  st bench_v2_$pass 150 $I/bin/attnserve_decode_bench_v2 --quick --only=$W
  st bench_v3_$pass 150 $I/bin/attnserve_decode_bench --quick --only=$W
done
for f in bench_v3_a bench_v3_b; do echo "== $f"; grep "kernel=decode workload" $O/l/$f.log | awk '{print $3,$5,$8,$9,$10,$11,$12,$13,$14,$15,$16}'; done
cat $O/l/summary.txt
fin
