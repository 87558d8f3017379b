# s19 r3: the commit: soft-capped bf16 rows at cap <= 38 run at a fixed maximum in the sm90 serving
# kernel (new = the binary) against main at the session's start (head); three passes interleaved;
# same-call cuDNN / FA2; the GPU kernel tests of the new binary (with SoftCapRowsAtTheFloor).
source .gpu/common.sh
B=$I/bin
W=long,long_cap,batch,batch_cap,prefix,prefix_sink,sweep_len512
for pass in a b c; do
  for v in head new; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
  done
done
st torch 120 python3 bench/torch_baselines.py --quick
st tests 300 $B/attnserve_gpu_kernel_tests
fin
