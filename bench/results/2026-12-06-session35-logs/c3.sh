# s35 c3: the decode kernel with per-CTA stamps (DecodeLaunchOptions::trace; null in the server, read
# from the kernel's parameters at each stamp). Its decode and FP8 tests; an A/B of the decode bench
# built at 6f9dd89 (_old) against this build (three passes alternating); then the traced launches of
# 256 x 4k and 8 x 128k, bf16 and FP8, at page_size 1 and 16.
source .gpu/common.sh
B=$I/bin
st decode_tests 120 $B/attnserve_gpu_decode_tests
st fp8_tests 150 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda*'
W=decode_b64,decode_b256,decode_b8_128k,decode_b256_e4m3,decode_b8_128k_e4m3
for p in a b c; do
  st old_$p 60 $B/attnserve_decode_bench_old --quick --only=$W
  st new_$p 60 $B/attnserve_decode_bench --quick --only=$W
done
st trace 60 $B/attnserve_decode_bench --quick --trace --only=$W
grep -h "^TRACE" $O/l/trace.log
fin
