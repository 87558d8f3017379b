# s25 c5: FP8 decode at four CTAs an SM (head_dim 128, one row tile: 3 ring stages, 128 registers; d4) against base (HEAD: 3 CTAs, 4 stages), two passes; decode and FP8 GPU tests on d4
source .gpu/common.sh
B=$I/bin
W=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3,decode_b1_e4m3,spec_b64_q4_e4m3,decode_b64_2k_e4m3,decode_b64_8k_e4m3,decode_b64_e5m2,decode_b256
for pass in a b; do
  st db_base_$pass 150 $B/attnserve_decode_bench --quick --only=$W
  st db_d4_$pass 150 $B/db_d4 --quick --only=$W
done
st tests_d4 200 $B/dt_d4 --gtest_filter='*Decode*:Fp8Cuda.*'
fin
