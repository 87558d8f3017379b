# s26 c3: fin2 (c2's final code, with the plan pricing the three-CTA kernel's pairs at pair_token_rate and cluster mode at the unpaired rate) against base (HEAD), three passes interleaved; the decode, FP8 and variant GPU tests on fin2; PyTorch's bf16 decode baselines
source .gpu/common.sh
B=$I/bin
st tests 200 $B/dt_fin2 --gtest_filter='*Decode*:Fp8Cuda.*:*Variants*'
W=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3,decode_b1_e4m3,spec_b64_q4_e4m3,decode_b64_2k_e4m3,decode_b64_8k_e4m3,decode_b100_e4m3,decode_b128_e4m3,decode_b512_e4m3,decode_b64_e5m2,decode_b64,decode_b256,decode_b8_128k
for pass in a b c; do
  st db_base_$pass 100 $B/db_base --quick --only=$W
  st db_fin2_$pass 100 $B/db_fin2 --quick --only=$W
done
st torch 150 python3 bench/torch_decode_baselines.py --quick
fin
