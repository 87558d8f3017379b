# s19 r4: the sm90 kernel body split into its roles (kernels/sm90/cta.cuh, producer.cuh, consumer.cuh; split = the
# binary) against the committed single body (fx = 949b9d9, r3's new); three passes interleaved, FP8 pools;
# the GPU kernel tests of split.
source .gpu/common.sh
B=$I/bin
W=long,long_cap,batch,batch_cap,prefix,prefix_sink,sweep_len512
for pass in a b c; do
  for v in fx split; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = split ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
    st f8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
st tests 300 $B/attnserve_gpu_kernel_tests
fin
