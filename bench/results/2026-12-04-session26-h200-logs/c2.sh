# s26 c2: the final code (fin: FP8 head_dim 128 three-CTA kernel in step pairs; the plan prices the four-CTA kernel past the three-CTA slots) against base (HEAD), three passes interleaved, and fin with --four_ctas=0 (pairs, three-CTA plan and kernel only); the whole GPU kernel suite on fin; memcheck over the FP8 and decode tests; PyTorch's bf16 decode baselines
source .gpu/common.sh
B=$I/bin
st tests 300 $B/dt_fin
st memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/dt_fin --gtest_filter='Fp8Cuda.*:PagedDecodeCuda.GeometryGrid:PagedDecodeCuda.ClusterMode'
W=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3,decode_b1_e4m3,spec_b64_q4_e4m3,decode_b64_2k_e4m3,decode_b64_8k_e4m3,decode_b100_e4m3,decode_b128_e4m3,decode_b512_e4m3,decode_b64_e5m2,decode_b64,decode_b256,decode_b8_128k
for pass in a b c; do
  st db_base_$pass 100 $B/db_base --quick --only=$W
  st db_fin_$pass 100 $B/db_fin --quick --only=$W
done
st db_fin3_a 100 $B/db_fin --quick --only=$W --four_ctas=0
st torch 150 python3 bench/torch_decode_baselines.py --quick
fin
