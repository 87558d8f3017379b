# s44 c3: c2's variants once more beside three more (pvar9.sh): c8 = eight max chains, c4m = four
# max chains with each row's two shuffles in turn (as HEAD orders them), c2m = two chains so.
# Three passes interleaved, bf16 and FP8 E4M3, page_size 1 and 16.
source .gpu/common.sh
B=$I/bin
PW=long,batch,prefix,sweep_len512
for p in a b c; do
  for v in head0 c4 c4m c8 c2m; do
    st kb16_${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16
    st kb8_${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
cat $O/l/summary.txt
fin
