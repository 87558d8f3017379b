source .gpu/common.sh
st run_mla 420 bash bench/run_mla_gpu.sh $I $O/l/mla
cat $O/l/mla/summary.txt
grep -B3 -A10 "Failure" $O/l/mla/*.log | head -40
st bench_b 60 $I/bin/attnserve_mla_bench
grep RESULT $O/l/bench_b.log
fin
