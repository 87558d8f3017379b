# s42 c2, in order of need (a call cut short keeps the first steps): sm90_fp8q on E5M2 caches
# (wgmma .e4m3.e5m2, session 41's patch), the tools' per-row LSE bounds (session 41) and the
# references' float64 query rounding (session 42): the FP8 kernel and backend tests; servers under
# --prefill_kernel=sm90_fp8q (E4M3, E5M2) and a default FP8 server, each under attnctl prefill,
# attnbench --verify and the Python reference (pyverify.py); two passes interleaving bf16,
# sm90_fp8q on E4M3 and E5M2, the default FP8 kernel on E4M3 and E5M2, an experiment for #32 (the
# FP8 kernels with 3 K stages and 2 V stages: kb_k3, kt_k3, built with k3.patch and
# -DATTNSERVE_EXP_FP8_K3, not in the tree) and PyTorch's baselines; the k3 kernels' FP8 tests; the
# rest of the GPU kernel tests last.
source .gpu/common.sh
B=$I/bin
D=bench/results/2026-12-07-session42-logs
export PYTHONPATH=$PWD/bench:$PWD/.gpu/site:$PWD/client/python PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, numpy, grpc; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__, "grpc", grpc.__version__)' 2>&1 | tee -a $O/l/device.txt
st kt_fp8 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*'
grep -h "FP8_PREFILL_ERROR\|FP8_Q_ERROR\|PASSED\|FAILED\|Which is\|Failure" $O/l/kt_fp8.log | tail -40
srv() { local n=$1; shift; $B/attnserve --listen=127.0.0.1:50071 --metrics_listen=127.0.0.1:50072 --head_dim=128 --num_qo_heads=32 --num_kv_heads=4 --page_size=16 --kv_cache_bytes=8589934592 "$@" > $O/l/srv_$n.log 2>&1 &
  for i in $(seq 1 200); do $B/attnctl --target=127.0.0.1:50071 health > /dev/null 2>&1 && break; sleep 0.2; done; }
for n in q q5 d; do
  case $n in
    q) srv q --kv_dtype=fp8_e4m3 --prefill_kernel=sm90_fp8q ;;
    q5) srv q5 --kv_dtype=fp8_e5m2 --prefill_kernel=sm90_fp8q ;;
    d) srv d --kv_dtype=fp8_e4m3 --prefill_kernel=auto ;;
  esac
  st ${n}_info 20 $B/attnctl --target=127.0.0.1:50071 info
  grep -h "fp8_query_min_rows\|kv_dtype" $O/l/${n}_info.log
  for k in 1 2 3; do st ${n}_prefill$k 60 $B/attnctl --target=127.0.0.1:50071 prefill --batch=3 --q_len=200 --kv_len=1500; tail -1 $O/l/${n}_prefill$k.log; done
  st ${n}_verify 60 $B/attnbench --target=127.0.0.1:50071 --workload=mixed --concurrency=4 --requests=200 --verify --kv_len=512
  st ${n}_verify_long 90 $B/attnbench --target=127.0.0.1:50071 --workload=prefill --batch=2 --q_len=1024 --kv_len=4096 --concurrency=2 --requests=20 --verify
  grep -h "wrong result" $O/l/${n}_verify*.log | head -5
  grep -h "errors:\|requests:" $O/l/${n}_verify.log $O/l/${n}_verify_long.log
  st ${n}_py 120 python3 $D/pyverify.py 127.0.0.1:50071
  grep -h "PYVERIFY\|WRONG\|Error" $O/l/${n}_py.log | head -5
  kill %1 2>/dev/null; wait 2>/dev/null; sleep 1
done
PW=long,batch,prefix,sweep_len512
for p in a b; do
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16
  st kbq_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_fp8q --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st kbq5_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_fp8q --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e5m2
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st kb5_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e5m2
  st kb8k3_$p 60 $B/kb_k3 --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st kbqk3_$p 60 $B/kb_k3 --quick --kernel=sm90_fp8q --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st torch_$p 90 python3 bench/torch_baselines.py --quick
done
grep -h "^RESULT" $O/l/kbq5_a.log | head -8
st kt_k3 300 $B/kt_k3 --gtest_filter='*Fp8Cuda.*'
grep -h "PASSED\|FAILED" $O/l/kt_k3.log | tail -5
st kt_rest 200 $B/attnserve_gpu_kernel_tests --gtest_filter='-*Fp8Cuda*'
grep -h "PASSED\|FAILED" $O/l/kt_rest.log | tail -8
cat $O/l/summary.txt
fin
