# s21 r3: final code (consumers convert their own Q rows, all passes together; converters K/V only) against old; bit-exact Q conversion probe; full suite.
source .gpu/common.sh
B=$I/bin
st tests_fp8 150 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda.*'
st probe_memcheck 120 compute-sanitizer --tool memcheck $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda.Sm90QRow*'
st probe_racecheck 120 compute-sanitizer --tool racecheck $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda.Sm90QRow*'
W=long,batch,prefix,sweep_len512
for pass in a b c; do
  st f8_old_$pass 60 $B/kb_old --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st f8_new_$pass 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st bf_new_$pass 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
done
st f8_new_q16 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
for v in old new; do
  b=$B/attnserve_kernel_bench; [ $v = old ] && b=$B/kb_old
  st e5_$v 60 $b --quick --kernel=sm90_overlap --workload=long,batch,prefix --page_sizes=1,16 --kv_dtype=fp8_e5m2
  st f8var_$v 60 $b --quick --kernel=sm90_overlap --workload=long_cap,batch_cap,prefix_sink --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
st suite 300 $B/attnserve_gpu_kernel_tests
fin
