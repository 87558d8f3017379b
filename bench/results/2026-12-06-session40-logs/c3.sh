# s40 c3: sm90_fp8q through the CUDA backend and the server: the backend test (prefill rows on FP8
# queries, decode rows on the decode family), then a server started with --kv_dtype=fp8_e4m3
# --head_dim=128 --prefill_kernel=sm90_fp8q: attnctl info, its build_info label, attnbench prefill
# traffic, and attnctl prefill and attnbench --verify (whose float64 reference rounds the queries
# as ServerInfo.fp8_query_min_rows says); one
# pass of bf16 and sm90_fp8q prefill after the consumers' Q conversion became one block.
source .gpu/common.sh
B=$I/bin
st kt_backend 120 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8CudaBackend*:*Sm90Fp8Queries*'
grep -h "PASSED\|FAILED\|OK \]\|Which is\|Failure" $O/l/kt_backend.log | tail -12
PW=long,batch,prefix,sweep_len512
st kb16_g 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16
st kbq_g 60 $B/attnserve_kernel_bench --quick --kernel=sm90_fp8q --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
$B/attnserve --listen=127.0.0.1:50071 --metrics_listen=127.0.0.1:50072 --kv_dtype=fp8_e4m3 --head_dim=128 --num_qo_heads=32 --num_kv_heads=4 --page_size=16 --kv_cache_bytes=8589934592 --prefill_kernel=sm90_fp8q > $O/l/srv.log 2>&1 &
for i in $(seq 1 200); do $B/attnctl --target=127.0.0.1:50071 health > /dev/null 2>&1 && break; sleep 0.2; done
st attnctl_info 20 $B/attnctl --target=127.0.0.1:50071 info
grep -h "fp8_query_min_rows\|kv_dtype\|head_dim" $O/l/attnctl_info.log
st attnctl_prefill 60 $B/attnctl --target=127.0.0.1:50071 prefill --batch=3 --q_len=200 --kv_len=1500
tail -3 $O/l/attnctl_prefill.log
curl -s 127.0.0.1:50072/metrics > $O/l/metrics.txt 2>/dev/null || python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:50072/metrics').read().decode())" > $O/l/metrics.txt
grep "attnserve_build_info" $O/l/metrics.txt
st bench_prefill 60 $B/attnbench --target=127.0.0.1:50071 --workload=prefill --batch=4 --q_len=2048 --concurrency=2 --requests=40
st bench_verify 60 $B/attnbench --target=127.0.0.1:50071 --workload=mixed --concurrency=4 --requests=40 --verify --kv_len=512
st holdings 20 $B/attnctl --target=127.0.0.1:50071 holdings
grep "attnserve_prefill_kernel\|family=\"sm90" $O/l/metrics.txt | head -5
python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:50072/metrics').read().decode())" | grep -i "kernel_launches\|family=" | head -12
kill %1 2>/dev/null; sleep 1
tail -5 $O/l/bench_prefill.log; tail -8 $O/l/bench_verify.log; head -3 $O/l/srv.log
fin
