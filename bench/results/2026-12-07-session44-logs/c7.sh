# s44 c7: the committed attnserve_decode_bench's --trace and --trace_dump (c1 ran it with the warp
# stamps' patch), and the SASS of the plain bf16 tensor-copy serving kernel of HEAD (head0) and of
# the change (fin), for the 32 x 512 question (why four chains lose 0.5-2.7% there).
source .gpu/common.sh
B=$I/bin
st trace 120 $B/attnserve_decode_bench --quick --trace --trace_dump=$O/l/trace.csv --only=decode_b8_128k,decode_b64
grep -h "TRACE" $O/l/trace.log; wc -l $O/l/trace.csv; head -3 $O/l/trace.csv
F=_ZN9attnserve4sm9029PagedPrefillSm90OverlapKernelILi128E13__nv_bfloat16Lb1ELb0ELb1ELb0ELb0ELb0ELNS_9Fp8FormatE0EEEvNS0_17PrefillKernelArgsE
for v in head0 fin; do
  st sass_$v 120 cuobjdump -sass -fun $F $B/kb_$v
  grep -c "FMNMX\|MUFU.EX2\|HGMMA\|WARPGROUP" $O/l/sass_$v.log
  gzip -f $O/l/sass_$v.log
done
cat $O/l/summary.txt
fin
