# s25 c4: the final code (FP8 consumers fence only for fp16 Q at turn 0): GPU suite, memcheck of the FP8 tests,
# A/B base (HEAD) vs final: FP8 three passes, bf16 one; same-call PyTorch cuDNN / FA2
source .gpu/common.sh
B=$I/bin
st tests 240 $B/attnserve_gpu_kernel_tests
st memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 9 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda.*'
W8=long,batch,prefix,sweep_len512,long_cap,batch_cap,prefix_sink
for pass in a b c; do
  for v in base fin; do
    bin=$B/kb_$v; [ $v = fin ] && bin=$B/attnserve_kernel_bench
    st kb8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W8 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
for v in base fin; do
  bin=$B/kb_$v; [ $v = fin ] && bin=$B/attnserve_kernel_bench
  st kb_${v}_a 100 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16
done
st torch 200 python3 bench/torch_baselines.py --quick
fin
