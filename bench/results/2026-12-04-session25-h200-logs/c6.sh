# s25 c6: FP8 decode's four-CTA kernel chosen by the launch (more items than the three-CTA kernel's slots):
# GPU suite (family_run's second run forces it); decode bench auto (-1) against three-CTA only (0), two passes; PyTorch decode baselines
source .gpu/common.sh
B=$I/bin
st tests 240 $B/attnserve_gpu_kernel_tests
W=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3,decode_b1_e4m3,spec_b64_q4_e4m3,decode_b64_2k_e4m3,decode_b64_8k_e4m3,decode_b100_e4m3,decode_b128_e4m3,decode_b512_e4m3,decode_b256,decode_b8_128k
for pass in a b; do
  st db_three_$pass 150 $B/attnserve_decode_bench --quick --only=$W --four_ctas=0
  st db_auto_$pass 150 $B/attnserve_decode_bench --quick --only=$W
done
st torch 150 python3 bench/torch_decode_baselines.py --quick
fin
