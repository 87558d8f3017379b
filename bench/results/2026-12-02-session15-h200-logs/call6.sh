source .gpu/common.sh
st mla_tests 200 $I/bin/attnserve_gpu_mla_tests
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran|Expected|Which is|tile_rows|split" $O/l/mla_tests.log | head -40
for pass in a b; do st mla_bench_$pass 120 $I/bin/attnserve_mla_bench; grep RESULT $O/l/mla_bench_$pass.log; done
fin
