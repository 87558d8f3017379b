# s21 r8: the traced kernels launched through LaunchKernel (kTrace), bf16 and FP8: the trace runs as before.
source .gpu/common.sh
B=$I/bin
for k in fp8_e4m3 bf16; do
  st trace_$k 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=batch --page_sizes=16 --kv_dtype=$k --trace=132
done
fin
