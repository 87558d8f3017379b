# s43 c3: the GPU tests' reference after the change (tests/gpu: the FP8-query rows rounded by the
# reference itself, reference::Seq::fp8_queries, and each LSE held to its row's bound; every
# fourth round of the FP8-query test with queries from N(0, 16)): the FP8 kernel and backend tests,
# then the rest of the kernel tests.
source .gpu/common.sh
B=$I/bin
st kt_fp8 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*'
grep -h "FP8_Q_ERROR\|PASSED\|FAILED\|Failure\|Which is\|bound" $O/l/kt_fp8.log | tail -40
st kt_rest 240 $B/attnserve_gpu_kernel_tests --gtest_filter='-*Fp8Cuda*'
grep -h "PASSED\|FAILED" $O/l/kt_rest.log | tail -8
cat $O/l/summary.txt
fin
