# s25 c2: A/B base (HEAD) vs new2 (descriptor read from smem where the global fetch was, before the epilogue), two passes; traces
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512,sweep_len1024,long_cap,batch_cap,prefix_sink
for pass in a b; do
  for v in base new2; do
    bin=$B/kb_$v
    st kb_${v}_$pass 100 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
    st kb8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
for v in base new2; do
  st tr_$v 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --trace=132
done
st tests 240 $B/kt_new2 --gtest_filter='*Sm90*:*PagedPrefillCuda*:*Variants*:*Fp8*'
fin
