# s27 c1: sm80 family on FP8 pools. Whole GPU kernel suite on the new code; memcheck + racecheck on the sm80 FP8 test;
# A/B sm80 bf16 base (HEAD c251d11) vs new; sm80 FP8 (e4m3, e5m2) vs sm90_overlap FP8; short sweeps.
source .gpu/common.sh
B=$I/bin
st kernel_tests 330 $B/kernel_tests
st memcheck_sm80fp8 150 compute-sanitizer --tool memcheck $B/kernel_tests --gtest_filter='Fp8Cuda.Sm80*:Fp8Cuda.Bf16Queries*'
st racecheck_sm80fp8 120 compute-sanitizer --tool racecheck $B/kernel_tests --gtest_filter='Fp8Cuda.Sm80*'
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
for pass in a b; do
  st kb16_base_$pass 120 $B/kb_base --quick --kernel=sm80 --workload=$W --page_sizes=1,16
  st kb16_new_$pass 120 $B/kb_new --quick --kernel=sm80 --workload=$W --page_sizes=1,16
  st kb8_sm80_$pass 120 $B/kb_new --quick --kernel=sm80 --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st kb8_sm90_$pass 120 $B/kb_new --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
st kb8_sm80_e5m2 120 $B/kb_new --quick --kernel=sm80 --workload=long,batch,sweep_len256 --page_sizes=1,16 --kv_dtype=fp8_e5m2
st kb8_sm80_fp16q 120 $B/kb_new --quick --kernel=sm80 --workload=long,batch,sweep_len256 --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
st kb_auto8 120 $B/kb_new --quick --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
fin
