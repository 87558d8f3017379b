# s36 c4: HEAD (053e7cf's kernels) with the GPU runners' new determinism check (tests/gpu/family_run.h: every
# decode batch's served launch twice, every prefill plan twice, the same bits): the decode suite and
# the whole kernel suite.
source .gpu/common.sh
B=$I/bin
st decode_tests 150 $B/attnserve_gpu_decode_tests
st kernel_tests 420 $B/attnserve_gpu_kernel_tests
grep -h "PASSED\|FAILED\|SKIPPED" $O/l/decode_tests.log $O/l/kernel_tests.log | tail -8
fin
