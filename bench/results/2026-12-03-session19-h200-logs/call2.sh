# s19 r2: the sm90 softmax's row maxima and sums in 4 running values (l4, the binary's default) or 2 (l2)
# instead of one chain (head = main at the session's start); fx4 = l4 + soft-capped bf16 rows (cap <= 38)
# at a fixed maximum. Three passes interleaved; FP8 pools; same-call cuDNN / FA2; GPU tests of l4 and fx4.
source .gpu/common.sh
B=$I/bin
W=long,long_cap,batch,batch_cap,prefix,prefix_sink,sweep_len512,sweep_len1024
for pass in a b c; do
  for v in head l4 l2 fx4; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = l4 ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
  done
done
for v in head l4; do
  bin=$B/attnserve_kernel_bench_$v; [ $v = l4 ] && bin=$B/attnserve_kernel_bench
  st f8_$v 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
st torch 120 python3 bench/torch_baselines.py --quick
st tests 280 $B/attnserve_gpu_kernel_tests
st tests_fx4 200 $B/attnserve_gpu_kernel_tests_fx4 --gtest_filter=*Variant*:*PagedPrefillCuda*:*Fp8*
fin
