# s41 c1: the default FP8 prefill kernel with S = Q K^T on FP8 tensor cores and bf16 queries carried
# whole as two E4M3 terms (QMode::kFp8Pair; E4M3 pools, head_dim 128): the FP8 kernel tests (the
# default kernel against the float64 reference over the queries as sent, every round's error
# printed), resource usage, three passes interleaving our bf16 prefill, HEAD's FP8 kernel (kb_head),
# the new one and PyTorch's baselines; then session 40's c3, which could not run then: the backend
# test of sm90_fp8q and a server under it (attnctl info and prefill, attnbench --verify), and a
# default FP8 server under attnbench --verify; the rest of the GPU kernel tests last.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
st kt_fp8 240 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*'
grep -h "FP8_PREFILL_ERROR\|PASSED\|FAILED\|OK \]\|Which is\|Failure" $O/l/kt_fp8.log | tail -60
for f in $I/lib/libattnserve*.so; do cuobjdump --dump-resource-usage $f 2>/dev/null; done > $O/l/resources.txt
grep -A1 "QMode2E" $O/l/resources.txt | grep -o "REG:[0-9]* STACK:[0-9]* SHARED:[0-9]* LOCAL:[0-9]*" | sort | uniq -c
PW=long,batch,prefix,sweep_len512
for p in a b c; do
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64
  st kb8old_$p 60 $B/kb_head --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st torch_$p 90 python3 bench/torch_baselines.py --quick
done
grep -h "^RESULT" $O/l/kb8_a.log | head -12
# session 40's c3
st kt_backend 120 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8CudaBackend*:*Sm90Fp8Queries*'
grep -h "PASSED\|FAILED\|OK \]\|Which is\|Failure" $O/l/kt_backend.log | tail -8
srv() { local n=$1; shift; $B/attnserve --listen=127.0.0.1:50071 --metrics_listen=127.0.0.1:50072 --kv_dtype=fp8_e4m3 --head_dim=128 --num_qo_heads=32 --num_kv_heads=4 --page_size=16 --kv_cache_bytes=8589934592 "$@" > $O/l/srv_$n.log 2>&1 &
  for i in $(seq 1 200); do $B/attnctl --target=127.0.0.1:50071 health > /dev/null 2>&1 && break; sleep 0.2; done; }
met() { python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:50072/metrics').read().decode())"; }
srv q --prefill_kernel=sm90_fp8q
st q_info 20 $B/attnctl --target=127.0.0.1:50071 info
grep -h "fp8_query_min_rows\|kv_dtype\|head_dim" $O/l/q_info.log
st q_prefill 60 $B/attnctl --target=127.0.0.1:50071 prefill --batch=3 --q_len=200 --kv_len=1500
tail -3 $O/l/q_prefill.log
st q_bench 60 $B/attnbench --target=127.0.0.1:50071 --workload=prefill --batch=4 --q_len=2048 --concurrency=2 --requests=40
st q_verify 60 $B/attnbench --target=127.0.0.1:50071 --workload=mixed --concurrency=4 --requests=40 --verify --kv_len=512
met > $O/l/q_metrics.txt; grep "attnserve_build_info" $O/l/q_metrics.txt
tail -4 $O/l/q_bench.log; tail -6 $O/l/q_verify.log
kill %1 2>/dev/null; wait 2>/dev/null; sleep 1
srv d --prefill_kernel=auto
st d_info 20 $B/attnctl --target=127.0.0.1:50071 info
grep -h "fp8_query_min_rows" $O/l/d_info.log
st d_prefill 60 $B/attnctl --target=127.0.0.1:50071 prefill --batch=3 --q_len=200 --kv_len=1500
tail -3 $O/l/d_prefill.log
st d_verify 60 $B/attnbench --target=127.0.0.1:50071 --workload=mixed --concurrency=4 --requests=40 --verify --kv_len=512
tail -6 $O/l/d_verify.log
kill %1 2>/dev/null; wait 2>/dev/null
st kt_rest 150 $B/attnserve_gpu_kernel_tests --gtest_filter='-*Fp8Cuda*'
grep -h "PASSED\|FAILED\|Which is\|Failure" $O/l/kt_rest.log | tail -12
fin
