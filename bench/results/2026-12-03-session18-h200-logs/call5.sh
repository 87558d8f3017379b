source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512,sweep_len1024
for pass in a b c; do
  for v in head new; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
    st f8_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
for v in head new; do
  bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
  st cap_${v} 60 $bin --quick --kernel=sm90_overlap --workload=long_cap,batch_cap,prefix_sink --page_sizes=16
  st trace_$v 60 $bin --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --trace=132
done
tar -C $O -czf $O/bench.tgz l
st tests 150 $B/attnserve_gpu_kernel_tests
grep -E "^\[  (PASSED|FAILED) |FAILED|Failure" $O/l/tests.log | head -20
for f in $O/l/kb_*.log $O/l/f8_*.log $O/l/cap_*.log; do echo "== $(basename $f)"; grep "^RESULT" $f | sed -E 's/.*workload=([^ ]+).*page_size=([0-9]+).*ms=([^ ]+) tflops=([^ ]+).*/\1 ps\2 \4/' | tr '\n' ';'; echo; done
cat $O/l/summary.txt
fin
