# s20 r2: conversion order. old = 34a03ae, oldv = old with V_{b-1} converted before K_b,
# new = loader/converter split (r1), newv = split with V_{b-1} first. Three passes interleaved, FP8 E4M3.
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix
for pass in a b c; do
  for v in old oldv new newv; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st f8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
fin
