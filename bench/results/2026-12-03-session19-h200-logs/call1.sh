# s19 r1: soft-cap softmax variants (#30): base = exponentials all on MUFU (HEAD's softmax), e2 = one in 2 by
# Exp2Fma (the binary's default), e4 = one in 4, fx = soft-capped bf16 rows with a fixed maximum (cap - 8, no
# row maxima), fx2 = fx + one in 2; ncu of base on long_cap and sweep_len512 (ps 16); GPU tests of e2 and fx2.
source .gpu/common.sh
B=$I/bin
W=long,long_cap,batch,batch_cap,prefix,prefix_sink,sweep_len512
for pass in a b; do
  for v in base e2 e4 fx fx2; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = e2 ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
  done
done
st tests_fx2 280 $B/attnserve_gpu_kernel_tests_fx2 --gtest_filter=*Variant*:*PagedPrefillCuda*:*Fp8*
st tests 280 $B/attnserve_gpu_kernel_tests
st ncu_cap 150 ncu --kernel-name regex:PagedPrefillSm90 --launch-skip 3 --launch-count 1 --set full --import-source no -f -o $O/l/ncu_cap $B/attnserve_kernel_bench_base --quick --kernel=sm90_overlap --workload=long_cap --page_sizes=16
ncu -i $O/l/ncu_cap.ncu-rep --page details > $O/l/ncu_cap_details.txt 2>&1
ncu -i $O/l/ncu_cap.ncu-rep --page source --csv --print-source sass > $O/l/ncu_cap_source.csv 2>&1
st ncu_512 150 ncu --kernel-name regex:PagedPrefillSm90 --launch-skip 3 --launch-count 1 --set full --import-source no -f -o $O/l/ncu_512 $B/attnserve_kernel_bench_base --quick --kernel=sm90_overlap --workload=sweep_len512 --page_sizes=16
ncu -i $O/l/ncu_512.ncu-rep --page details > $O/l/ncu_512_details.txt 2>&1
ncu -i $O/l/ncu_512.ncu-rep --page source --csv --print-source sass > $O/l/ncu_512_source.csv 2>&1
rm -f $O/l/*.ncu-rep
fin
