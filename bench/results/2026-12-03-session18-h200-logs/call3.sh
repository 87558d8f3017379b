# r3: head = 34645db, new = the next tile's descriptor lines prefetched into L1 a tile ahead
# (WarmDescriptors in ForEachTile); not kept.
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512,sweep_len1024
for pass in a b c; do
  for v in head new; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
  done
done
for v in head new; do
  bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
  st f8_${v} 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st trace_$v 60 $bin --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --trace=132
done
st tests 280 $B/attnserve_gpu_kernel_tests
fin
