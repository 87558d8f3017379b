# s26 c1: FP8 decode, two steps a warp iteration (p4: 4 stages, 3 CTAs an SM; p6: 6 stages, 2 CTAs an SM) against base (HEAD) and new (the restructured loop, one step an iteration), two passes interleaved; decode / FP8 / variant GPU tests on new, p4, p6
source .gpu/common.sh
B=$I/bin
W=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3,decode_b1_e4m3,spec_b64_q4_e4m3,decode_b64_2k_e4m3,decode_b64_8k_e4m3,decode_b128_e4m3,decode_b64_cap,decode_b64,decode_b256
for v in new p4 p6; do st tests_$v 150 $B/dt_$v --gtest_filter='*Decode*:Fp8Cuda.*:*Variants*decode*'; done
for pass in a b; do
  for v in base new p4 p6; do st db_${v}_$pass 100 $B/db_$v --quick --only=$W; done
done
fin
