# s24 c3: soft-capped rows: S_t issued as two wgmma groups of 64 keys, the first half's tanh run while the
# second half's GEMM is on the tensor cores (splits) against base (HEAD); three passes interleaved; the
# variant / sm90 GPU tests of splits.
source .gpu/common.sh
B=$I/bin
W=long,long_cap,batch,batch_cap,prefix,prefix_cap,prefix_sink
for pass in a b c; do
  for v in base splits; do
    bin=$B/kb_$v; [ $v = base ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
  done
done
F='*Variants*:*Sm90*:*PagedPrefillCuda*sm90*'
st t_splits 200 $B/kt_splits --gtest_filter="$F"
fin
