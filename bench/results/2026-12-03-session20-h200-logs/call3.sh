# s20 r3: a fourth warpgroup converts (ConverterRole); producer and converters at 40 registers.
# new = this binary, old = 34a03ae's. FP8 tests first, then three interleaved passes, then the rest of the suite.
source .gpu/common.sh
B=$I/bin
st fp8tests 200 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda*'
W=long,batch,prefix,sweep_len512
for pass in a b c; do
  for v in old new; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st f8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  done
done
for v in old new; do
  bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
  st bf_${v} 60 $bin --quick --kernel=sm90_overlap --workload=$W,long_cap,batch_cap --page_sizes=1,16
  st f8cap_${v} 60 $bin --quick --kernel=sm90_overlap --workload=long_cap,batch_cap,prefix_sink --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st e5_${v} 60 $bin --quick --kernel=sm90_overlap --workload=long,batch --page_sizes=1,16 --kv_dtype=fp8_e5m2
done
st tests 300 $B/attnserve_gpu_kernel_tests --gtest_filter='-Fp8Cuda*'
fin
