# s44 c8: #34's "page_size 16 and 64 at least as fast as page_size 1": does the tensor-copy path
# lose to cp.async on short sequences? fin (the committed kernels) against notma (the same, with
# SetTmaMaps leaving tma_run 0: cp.async for every page size), three interleaved passes, bf16 and
# FP8 E4M3, the length sweep and the workloads at page_size 16 and 64 (1 as a reference).
source .gpu/common.sh
B=$I/bin
PW=long,batch,prefix,sweep_len256,sweep_len512,sweep_len1024,sweep_len2048,sweep_len4096
for p in a b c; do
  for v in fin notma; do
    st kb16_${v}_$p 90 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64
    st kb8_${v}_$p 90 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  done
done
cat $O/l/summary.txt
fin
