source .gpu/common.sh
st mla_tests 200 $I/bin/attnserve_gpu_mla_tests
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran|Expected|Which is|tile_rows" $O/l/mla_tests.log | head -40
st mla_memcheck 150 compute-sanitizer --error-exitcode=1 $I/bin/attnserve_gpu_mla_tests --gtest_filter='*H128Ps1PrefillFp16Variants*:*H128Ps64DecodeBf16Variants*'
tail -4 $O/l/mla_memcheck.log
st mla_racecheck 200 compute-sanitizer --tool racecheck --error-exitcode=1 $I/bin/attnserve_gpu_mla_tests --gtest_filter='*H128Ps16DecodeBf16*'
tail -4 $O/l/mla_racecheck.log
st mla_bench 120 $I/bin/attnserve_mla_bench
grep -E "RESULT" $O/l/mla_bench.log
st mla_torch 60 python3 bench/mla_torch.py
grep TORCH $O/l/mla_torch.log
st mla_server 150 env ATTNSERVE_BIN=$I/bin/attnserve ATTNSERVE_TEST_SERVER_FLAGS=--backend=cuda ATTNSERVE_TEST_MLA_WIDTHS=512,64 $I/bin/integration_test --gtest_filter='MlaServerTest.*:PageSizes/MlaPrefillTest.*'
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran" $O/l/mla_server.log | head -20
fin
