# s21 r4: soft-capped rows with part of their exp2 on the FMA pipe (Exp2Fma): 1 in 2 (new), 1 in 4 (s4), none (s0, the same code otherwise).
source .gpu/common.sh
B=$I/bin
st tests_new 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*VariantsCuda*:Fp8Cuda.Sm90Prefill*'
st tests_s4 300 $B/tests_s4 --gtest_filter='*VariantsCuda*SoftCap*'
for pass in a b c; do
  for v in s0 s4 new; do
    b=$B/kb_$v; [ $v = new ] && b=$B/attnserve_kernel_bench
    st bfcap_${v}_$pass 60 $b --quick --kernel=sm90_overlap --workload=long_cap,batch_cap,prefix_cap --page_sizes=1,16
  done
done
for v in s0 new; do
  b=$B/kb_$v; [ $v = new ] && b=$B/attnserve_kernel_bench
  st bf_${v}_plain 60 $b --quick --kernel=sm90_overlap --workload=long,batch,prefix --page_sizes=1,16
  st f8cap_${v}_x 60 $b --quick --kernel=sm90_overlap --workload=long_cap,batch_cap --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
fin
