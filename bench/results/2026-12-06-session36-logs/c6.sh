# s36 c6: the decode kernel's epilogue moved into kernels/decode/epilogue.cuh (TileOut; the same code as
# functions): the decode suite, the FP8 and variants suites, and an A/B against the decode bench of
# 053e7cf (_old), four passes alternating.
source .gpu/common.sh
B=$I/bin
st decode_tests 150 $B/attnserve_gpu_decode_tests
st kt_fp8_var 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*:*VariantsCuda*'
W=decode_b1,decode_b64,decode_b256,decode_b8_128k,decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3
for p in a b c d; do
  st old_$p 90 $B/attnserve_decode_bench_old --quick --only=$W
  st new_$p 90 $B/attnserve_decode_bench --quick --only=$W
done
grep -h "PASSED\|FAILED" $O/l/decode_tests.log $O/l/kt_fp8_var.log
fin
