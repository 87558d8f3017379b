# s27 c2: sm80 FP8 with bf16 Q converted through registers before the loop (v2) against c1's in-loop conversion (v1); FP8 tests on v2
source .gpu/common.sh
B=$I/bin
st fp8_tests 200 $B/kernel_tests --gtest_filter='Fp8Cuda*:*Sm80*'
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
for pass in a b; do
  for v in v1 v2; do
    st kb8_${v}_$pass 120 $B/kb_$v --quick --kernel=sm80 --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
st kb8_v2_fp16q 120 $B/kb_v2 --quick --kernel=sm80 --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
st kb16_v2_fp16q 120 $B/kb_v2 --quick --kernel=sm80 --workload=$W --page_sizes=1,16 --q_dtype=fp16
st kb_auto8 120 $B/kb_v2 --quick --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
fin
