# s25 c7: the four-CTA choice from per-device occupancy (PerDeviceInt): decode and FP8 GPU tests; decode bench auto against --four_ctas=0, one pass
source .gpu/common.sh
B=$I/bin
st tests 150 $B/attnserve_gpu_kernel_tests --gtest_filter='*Decode*:Fp8Cuda.*'
W=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3,decode_b128_e4m3
st db_three 100 $B/attnserve_decode_bench --quick --only=$W --four_ctas=0
st db_auto 100 $B/attnserve_decode_bench --quick --only=$W
fin
