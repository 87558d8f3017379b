# s24 c1: MUFU throughput/accuracy of f32 vs packed-half tanh and ex2; the sm90 soft-cap softmax with
# tanh on packed halves (th2) and tanh + ex2 on packed halves at a running max (th2e2) against base
# (HEAD); two passes interleaved; same-call cuDNN / FA2; variant and sm90 GPU tests of th2, th2e2.
source .gpu/common.sh
B=$I/bin
st mufu 60 $B/mufu
cuobjdump -sass $B/mufu 2>&1 | grep -E "Function|MUFU" | sort | uniq -c > $O/l/mufu_sass.txt
W=long,long_cap,batch,batch_cap
for pass in a b; do
  for v in base th2 th2e2; do
    bin=$B/kb_$v; [ $v = base ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
  done
done
st torch 120 python3 bench/torch_baselines.py --quick
F='*Variants*sm90*:*Sm90*:*PagedPrefillCuda*sm90_overlap*'
for v in th2 th2e2; do st t_$v 150 $B/kt_$v --gtest_filter="$F"; done
fin
