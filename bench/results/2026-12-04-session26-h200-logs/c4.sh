# s26 c4: the 16-bit decode kernel at head_dim 128 with 16-row tiles in step pairs too (b16p: 3 ring stages, two CTAs an SM) against fin2, three passes interleaved; the decode and variant GPU tests on b16p
source .gpu/common.sh
B=$I/bin
st tests 200 $B/dt_b16p --gtest_filter='*Decode*:*Variants*decode*'
W=decode_b64,decode_b256,decode_b8_128k,decode_b64_cap,decode_b64_sink,decode_b1,spec_b64_q4
for pass in a b c; do
  st db_fin2_$pass 100 $B/db_fin2 --quick --only=$W
  st db_b16p_$pass 100 $B/db_b16p --quick --only=$W
done
fin
