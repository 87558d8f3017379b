# s27 c3 (planned; not run: no machine was lent after c2): the final code (c2's kernels) under the whole GPU kernel suite, the decode suite and memcheck of the sm80 FP8 tests;
# sm80 FP8 (e4m3 two passes, e5m2, fp16 queries) against sm80 bf16, sm90_overlap FP8 and bf16, auto on FP8; PyTorch cuDNN / FA2
source .gpu/common.sh
B=$I/bin
st kernel_tests 330 $B/kernel_tests
st decode_tests 120 $B/decode_tests
st memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/kernel_tests --gtest_filter='Fp8Cuda.Sm80*:Fp8Cuda.Bf16Queries*'
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
st kb16_sm80 120 $B/kb --quick --kernel=sm80 --workload=$W --page_sizes=1,16
for pass in a b; do
  st kb8_sm80_$pass 120 $B/kb --quick --kernel=sm80 --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
st kb8_sm80_e5m2 120 $B/kb --quick --kernel=sm80 --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e5m2
st kb8_sm80_fp16q 120 $B/kb --quick --kernel=sm80 --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
st kb8_sm90 120 $B/kb --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
st kb16_sm90 120 $B/kb --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
st kb_auto8 120 $B/kb --quick --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
st torch 200 python3 bench/torch_baselines.py --quick
fin
