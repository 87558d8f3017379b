# s25 c3: A/B base (HEAD) vs nf (the consumers' proxy fence only for turns that read cp.async rows), two passes; traces; GPU suite on nf
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512,sweep_len1024,long_cap,batch_cap,prefix_sink
for pass in a b; do
  for v in base nf; do
    bin=$B/kb_$v
    st kb_${v}_$pass 100 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
    st kb8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
for v in base nf; do
  st tr_$v 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --trace=132
done
st tests 240 $B/kt_nf
st tests_rep 200 $B/kt_nf --gtest_filter='*Sm90*:*PagedPrefillCuda*sm90*:*Variants*sm90*' --gtest_repeat=3
fin
