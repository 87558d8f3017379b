source .gpu/common.sh
st mla_tests 150 $I/bin/attnserve_gpu_mla_tests
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran" $O/l/mla_tests.log | head -20
st mla_sanitizer 100 compute-sanitizer --error-exitcode=1 $I/bin/attnserve_gpu_mla_tests --gtest_filter='*H16Ps16DecodeBf16*:*H128Ps1PrefillFp16Variants*'
tail -3 $O/l/mla_sanitizer.log
st mla_server 150 env ATTNSERVE_BIN=$I/bin/attnserve ATTNSERVE_TEST_SERVER_FLAGS=--backend=cuda ATTNSERVE_TEST_MLA_WIDTHS=512,64 ATTNSERVE_MLA_CUDA_UNVALIDATED=1 $I/bin/integration_test --gtest_filter='MlaServerTest.*:PageSizes/MlaPrefillTest.*'
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran" $O/l/mla_server.log | head -20
st mla_bench 60 $I/bin/attnserve_mla_bench
grep -E "RESULT" $O/l/mla_bench.log
st mla_torch 60 python3 bench/mla_torch.py
grep TORCH $O/l/mla_torch.log
fin
