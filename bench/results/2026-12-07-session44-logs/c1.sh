# s44 c1: (1) the decode kernel's per-CTA and per-warp stamps (#34: why equal CTAs of a
# one-wave launch stream at different speeds: SM pairs, warps, SMs), two traced launches of
# each workload, every CTA dumped; (2) session 43's c5, the ncu profile of the default FP8
# prefill against bf16 (#32).
source .gpu/common.sh
B=$I/bin
D=bench/results/2026-12-07-session44-logs
for r in 1 2; do
  st trace_$r 150 $B/attnserve_decode_bench --quick --trace --trace_dump=$O/l/trace_$r.csv --only=decode_b8_128k,decode_b256,decode_b64,decode_b8_128k_e4m3,decode_b256_e4m3
  grep -h "TRACE" $O/l/trace_$r.log
done
for k in bf16 fp8_e4m3; do
  st ncu_$k 200 ncu --set full --import-source no -k regex:PagedPrefillSm90OverlapKernel --launch-count 1 -f -o $O/l/ncu_$k $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long --page_sizes=16 --kv_dtype=$k
  ncu -i $O/l/ncu_$k.ncu-rep --page details > $O/l/details_$k.txt 2>&1
  ncu -i $O/l/ncu_$k.ncu-rep --page source --csv --print-source sass > $O/l/src_$k.csv 2> $O/l/src_$k.err || ncu -i $O/l/ncu_$k.ncu-rep --page source --csv > $O/l/src_$k.csv 2>> $O/l/src_$k.err
  python3 bench/results/2026-12-07-session43-logs/srcsum.py $O/l/src_$k.csv > $O/l/srcsum_$k.txt 2>&1
  head -25 $O/l/srcsum_$k.txt
  ncu -i $O/l/ncu_$k.ncu-rep --page raw --csv > $O/l/raw_$k.csv 2>&1
  python3 -c "import csv,sys; r=list(csv.reader(open(sys.argv[1]))); [print(h, u, v) for h, u, v in zip(r[0], r[1], r[2]) if 'stalled' in h or 'issue_active' in h or 'inst_executed_pipe' in h]" $O/l/raw_$k.csv > $O/l/stalls_$k.txt 2>&1
  gzip -f $O/l/src_$k.csv $O/l/raw_$k.csv
  rm -f $O/l/ncu_$k.ncu-rep
done
grep -h "Issue Slots Busy\|No Eligible\|Active Warps Per Scheduler\|Eligible Warps\|Warp Cycles Per Issued\|Issued Warp Per Scheduler\|Duration\|Compute (SM) Throughput" $O/l/details_*.txt
cat $O/l/summary.txt
fin
