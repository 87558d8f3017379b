# s26 c8: after the review commit (DecodeHasWideKernel; the decode harness's tile rows computed once): the decode, FP8 and variant GPU tests
source .gpu/common.sh
B=$I/bin
st tests 200 $B/dt_r --gtest_filter='*Decode*:Fp8Cuda.*:*Variants*'
fin
