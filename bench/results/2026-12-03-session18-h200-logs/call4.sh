source .gpu/common.sh
B=$I/bin
st tests 280 $B/attnserve_gpu_kernel_tests
grep -E "^\[  (PASSED|FAILED) |FAILED|Failure" $O/l/tests.log | head -20
W=long,batch,prefix,sweep_len512,sweep_len1024
for pass in a b c; do
  for v in head new; do
    bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
    st kb_${v}_$pass 60 $bin --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
  done
done
for v in head new; do
  bin=$B/attnserve_kernel_bench_$v; [ $v = new ] && bin=$B/attnserve_kernel_bench
  st f8_${v} 60 $bin --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st cap_${v} 60 $bin --quick --kernel=sm90_overlap --workload=long_cap,batch_cap,prefix_sink --page_sizes=16
  st trace_$v 60 $bin --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --trace=132
done
for f in $O/l/kb_*.log $O/l/f8_*.log $O/l/cap_*.log; do echo "== $(basename $f)"; grep "^RESULT" $f | sed -E 's/.*workload=([^ ]+).*page_size=([0-9]+).*ms=([^ ]+) tflops=([^ ]+).*/\1 ps\2 \4/' | tr '\n' ';'; echo; done
grep -h "tile_epilogue\|rel_wg0_epilogue_sums\|tile_wait_q\|tile_gap\|tile_wait_k0\|p_issue" $O/l/trace_*.log
GB100=107374182400
srv() { # name, flags...
  local n=$1; shift
  $B/attnserve --backend=cuda --num_layers=32 --kv_cache_bytes=$GB100 "$@" > $O/l/srv_$n.log 2>&1 &
  local pid=$!
  for _ in $(seq 1 900); do grep -q "listening grpc=" $O/l/srv_$n.log && break; sleep 0.1; done
  grep -E "started|listening" $O/l/srv_$n.log | cut -c1-400
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | sed "s/^/$n gpu memory used, total: /" | tee -a $O/l/mem.txt
  st info_$n 30 $B/attnctl info
  cat $O/l/info_$n.log
  st prefill_$n 60 $B/attnctl prefill --batch=8 --q_len=64 --kv_len=2048
  tail -3 $O/l/prefill_$n.log
  st decode_$n 60 $B/attnctl prefill --batch=64 --q_len=1 --kv_len=4096
  tail -3 $O/l/decode_$n.log
  kill -TERM $pid; wait $pid
}
srv bf16 --kv_dtype=bf16
srv fp8 --kv_dtype=fp8_e4m3
cat $O/l/summary.txt
fin
