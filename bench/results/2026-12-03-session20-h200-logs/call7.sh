# s20 r7: FP8 at head_dim 128 with 3 K stages and 2 V stages (k3) against the final code (new).
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512
for pass in a b c; do
  for v in new k3; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st f8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
fin
