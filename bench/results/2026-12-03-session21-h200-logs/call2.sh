# s21 r2: Q conversion in groups of passes (loads, shuffles, products of G passes together): consumers G=8 (new), G=4 (b4); converters G=2 (a2), G=4 (a4); old.
source .gpu/common.sh
B=$I/bin
st tests_new 120 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda.*'
st tests_a2 120 $B/tests_a2 --gtest_filter='Fp8Cuda.*'
W=long,batch,prefix,sweep_len512
for pass in a b c; do
  for v in old a2 a4 b4; do st f8_${v}_$pass 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3; done
  st f8_new_$pass 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
st f8_new_q16 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
fin
