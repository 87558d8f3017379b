# s25 c1: GPU suite on new (producer publishes the next tile's descriptor in smem); A/B base (HEAD) vs new, two passes; traces
source .gpu/common.sh
B=$I/bin
st tests 240 $B/attnserve_gpu_kernel_tests
W=long,batch,prefix,sweep_len512,sweep_len1024,long_cap,batch_cap,prefix_sink
for pass in a b; do
  for v in base new; do
    bin=$B/kb_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 100 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
    st kb8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
for v in base new; do
  bin=$B/kb_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
  st tr_$v 60 $bin --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --trace=132
done
fin
