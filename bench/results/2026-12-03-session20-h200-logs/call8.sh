# s20 r8: FP8 E4M3 pools with bf16 queries (converted to fp16 per row by the converters) against fp16 queries (no Q conversion); bf16 pools as the bar. Final code.
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512
for pass in a b; do
  st f8_qbf16_$pass 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st f8_qfp16_$pass 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
  st bf_qbf16_$pass 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
done
fin
