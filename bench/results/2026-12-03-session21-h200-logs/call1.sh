# s21 r1: cheaper Q conversion (integer row max, bf16 product) on the converters (kb_a) and with each consumer warpgroup converting its own rows (new), against old (session 20 final).
source .gpu/common.sh
B=$I/bin
st tests_new 120 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda.*'
st tests_a 120 $B/tests_a --gtest_filter='Fp8Cuda.*'
W=long,batch,prefix,sweep_len512
for pass in a b c; do
  st f8_old_$pass 60 $B/kb_old --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st f8_a_$pass 60 $B/kb_a --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st f8_new_$pass 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
st f8_new_q16 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
st bf_new 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
st f8_old_64 60 $B/kb_old --quick --kernel=sm90_overlap --workload=$W --page_sizes=64 --kv_dtype=fp8_e4m3
st f8_new_64 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=64 --kv_dtype=fp8_e4m3
st f8_a_64 60 $B/kb_a --quick --kernel=sm90_overlap --workload=$W --page_sizes=64 --kv_dtype=fp8_e4m3
for v in 0 1 old; do cuobjdump -sass $I/cubin/q1_$v.cubin > $O/l/sass_$v.txt 2>&1; done
st suite_new 300 $B/attnserve_gpu_kernel_tests
fin
