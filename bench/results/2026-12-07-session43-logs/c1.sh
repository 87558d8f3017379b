# s43 c1: HEAD (5d18ee5) on a GPU, in order of need: session 42's scale-aware LSE bound for the
# FP8-query kernel against servers (sm90_fp8q on E4M3 and E5M2, queries from N(0,4) and N(0,16),
# attnctl prefill, attnbench --verify, the Python reference through pyverify.py); the FP8 kernel
# tests; the rest of the GPU kernel tests; the decode, server, region and MLA GPU suites.
source .gpu/common.sh
B=$I/bin
D=bench/results/2026-12-07-session43-logs
export PYTHONPATH=$PWD/bench:$PWD/.gpu/site:$PWD/client/python PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, numpy, grpc; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__, "grpc", grpc.__version__)' 2>&1 | tee -a $O/l/device.txt
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
  st ${n}_prefill 60 $B/attnctl --target=127.0.0.1:50071 prefill --batch=3 --q_len=200 --kv_len=1500
  tail -1 $O/l/${n}_prefill.log
  st ${n}_verify 60 $B/attnbench --target=127.0.0.1:50071 --workload=mixed --concurrency=4 --requests=200 --verify --kv_len=512
  st ${n}_verify_long 90 $B/attnbench --target=127.0.0.1:50071 --workload=prefill --batch=2 --q_len=1024 --kv_len=4096 --concurrency=2 --requests=20 --verify
  grep -h "wrong result" $O/l/${n}_verify*.log | head -5
  grep -h "errors:\|requests:" $O/l/${n}_verify.log $O/l/${n}_verify_long.log
  for qs in 2 4; do
    st ${n}_py$qs 120 python3 $D/pyverify.py 127.0.0.1:50071 $qs
    grep -h "PYVERIFY\|WRONG\|Error" $O/l/${n}_py$qs.log | head -5
  done
  kill %1 2>/dev/null; wait 2>/dev/null; sleep 1
done
st kt_fp8 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*'
grep -h "FP8_Q_ERROR worst\|PASSED\|FAILED" $O/l/kt_fp8.log | tail -10
st kt_rest 240 $B/attnserve_gpu_kernel_tests --gtest_filter='-*Fp8Cuda*'
grep -h "PASSED\|FAILED" $O/l/kt_rest.log | tail -8
st dt 120 $B/attnserve_gpu_decode_tests
grep -h "PASSED\|FAILED" $O/l/dt.log | tail -4
st mla 120 $B/attnserve_gpu_mla_tests
grep -h "PASSED\|FAILED" $O/l/mla.log | tail -4
cat $O/l/summary.txt
fin
