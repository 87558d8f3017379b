# s20 r4: the converters' step loop unrolled by 1 / 2 (new) / 4; ncu of new (FP8 batch, page_size 16).
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix
for pass in a b c; do
  for v in new u1 u4; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st f8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
st ncu 240 ncu --kernel-name regex:PagedPrefillSm90 --launch-skip 3 --launch-count 1 --set full --import-source no -f -o $O/l/batch16 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=batch --page_sizes=16 --kv_dtype=fp8_e4m3
st ncu_det 60 ncu -i $O/l/batch16.ncu-rep --page details
st ncu_src 60 ncu -i $O/l/batch16.ncu-rep --page source --csv --print-source sass
gzip $O/l/ncu_src.log; rm -f $O/l/batch16.ncu-rep
fin
