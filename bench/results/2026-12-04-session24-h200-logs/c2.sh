# s24 c2: the three sm90 schedules (overlap + ping-pong, overlap without ping-pong, serial ping-pong) on
# plain and soft-capped workloads, bf16 and FP8 pools; two passes interleaved (base = HEAD).
source .gpu/common.sh
B=$I/bin
W=long,long_cap,batch,batch_cap,prefix,prefix_cap
for pass in a b; do
  for k in sm90_overlap sm90_overlap_nopp sm90; do
    st kb_${k}_$pass 60 $B/attnserve_kernel_bench --quick --kernel=$k --workload=$W --page_sizes=1,16
    st f8_${k}_$pass 60 $B/attnserve_kernel_bench --quick --kernel=$k --workload=long,long_cap,batch,batch_cap --page_sizes=16 --kv_dtype=fp8_e4m3
  done
done
fin
