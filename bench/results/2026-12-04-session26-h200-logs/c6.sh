# s26 c6: the four-CTA FP8 kernel in step pairs too (w4p: 3 stages, 128 registers, 88 bytes of spills) against fin2, three passes, the launches that run it; FP8 GPU tests on w4p
source .gpu/common.sh
B=$I/bin
W=decode_b256_e4m3,decode_b100_e4m3,decode_b128_e4m3,decode_b512_e4m3
for pass in a b c; do
  st db_fin2_$pass 100 $B/db_fin2 --quick --only=$W
  st db_w4p_$pass 100 $B/db_w4p --quick --only=$W
done
st tests_w4p 150 $B/dt_w4p --gtest_filter='Fp8Cuda.Decode*'
fin
