# s38 c2: FP8 blocks land in raw slots of their own (Traits::kRawSlots), converted into their fp16
# stage once the consumers release it: the FP8 and variants kernel tests on it, then FP8 E4M3
# sm90_overlap prefill, the raw slots (new) against HEAD's in-place conversion (kb_head), four passes
# alternating; one pass of E5M2 and of fp16 queries each.
source .gpu/common.sh
B=$I/bin
st kt_fp8_var 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*:*VariantsCuda*'
PW=long,batch,prefix,sweep_len512
for p in a b c d; do
  for v in head new; do
    k=$B/attnserve_kernel_bench; [ $v = head ] && k=$B/kb_head
    st kb8_${v}_$p 60 $k --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  done
done
for v in head new; do
  k=$B/attnserve_kernel_bench; [ $v = head ] && k=$B/kb_head
  st kb5_${v} 60 $k --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e5m2
  st kbh_${v} 60 $k --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
done
st kb16_new 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64
grep -h "PASSED\|FAILED\|passed\|failed" $O/l/kt_fp8_var.log | tail -5
fin
