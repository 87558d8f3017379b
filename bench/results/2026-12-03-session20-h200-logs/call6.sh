# s20 r6: the GPU kernel suite on the final binary (r5's).
source .gpu/common.sh
B=$I/bin
st tests 400 $B/attnserve_gpu_kernel_tests
fin
