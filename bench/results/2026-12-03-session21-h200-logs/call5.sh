# s21 r5: where the FP8 kernel's consumers wait: --trace (the traced kernel, now also on FP8 pools) for batch and 32x512 at page_size 1 and 16, FP8 and bf16; ncu of FP8 batch page_size 16.
source .gpu/common.sh
B=$I/bin
for k in fp8_e4m3 bf16; do
  st trace_$k 120 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=batch,sweep_len512,long --page_sizes=1,16 --kv_dtype=$k --trace=132
done
k=fp8_e4m3
st ncu_$k 200 ncu --kernel-name regex:PagedPrefillSm90 --launch-skip 3 --launch-count 1 --set full --import-source no -f -o $O/l/b16_$k $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=batch --page_sizes=16 --kv_dtype=$k
st ncu_det_$k 60 ncu -i $O/l/b16_$k.ncu-rep --page details
st ncu_src_$k 60 ncu -i $O/l/b16_$k.ncu-rep --page source --csv --print-source sass
gzip $O/l/ncu_src_$k.log; rm -f $O/l/b16_$k.ncu-rep
fin
