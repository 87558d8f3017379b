source .gpu/common.sh
st mla_tests 120 $I/bin/attnserve_gpu_mla_tests
grep -E "^\[  (PASSED|FAILED) |Failure" $O/l/mla_tests.log | head -10
st decode_tests 90 $I/bin/attnserve_gpu_decode_tests
grep -E "^\[  (PASSED|FAILED) |Failure" $O/l/decode_tests.log | head -10
st mla_bench 60 $I/bin/attnserve_mla_bench --only=decode_h128,decode_h128_ps1,decode_h16
grep RESULT $O/l/mla_bench.log
fin
