# s20 r5: the converters' reads without bank conflicts (odd rows read their upper half first).
# new = this binary, r3 = r3's (fourth warpgroup), old = 34a03ae's. FP8 tests first, then three interleaved passes.
source .gpu/common.sh
B=$I/bin
st fp8tests 200 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda*:VariantsCuda*'
W=long,batch,prefix,sweep_len512
for pass in a b c; do
  for v in old r3 new; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st f8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
    st bf_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
  done
done
for v in r3 new; do
  bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
  st f8cap_${v} 60 $bin --quick --kernel=sm90_overlap --workload=long_cap,batch_cap,prefix_sink --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st e5_${v} 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix --page_sizes=1,16 --kv_dtype=fp8_e5m2
done
st torch 200 python3 bench/torch_baselines.py
fin
