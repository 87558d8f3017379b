# r2: base = 34645db's barrier arrivals (ATTNSERVE_SM90_LANE_ARRIVALS=1: every lane arrives), new = one
# arrival per warp (lane 0 with count 32 / the ballot of the lanes without a copy), late = new with the
# consumers' next-tile fetch after the epilogue's stores. Variant binaries: kernels/sm90/prefill.cu and
# prefill_fp8.cu recompiled with the -D flag and linked into attnserve_kernel_bench. Neither change kept.
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512
for pass in a b; do
  for v in base new late; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
    st f8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
st torch 60 python3 bench/torch_baselines.py --quick
st trace_new 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --trace=132
st trace_base 60 $B/attnserve_kernel_bench_base --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --trace=132
st tests 280 $B/attnserve_gpu_kernel_tests
fin
