source .gpu/common.sh
st mla_tests 200 $I/bin/attnserve_gpu_mla_tests
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran" $O/l/mla_tests.log | head -10
st mla_memcheck 150 compute-sanitizer --error-exitcode=1 $I/bin/attnserve_gpu_mla_tests --gtest_filter='*H128Ps1PrefillFp16Variants*:*H128Ps64DecodeBf16Variants*:*H16Ps16DecodeBf16*'
tail -2 $O/l/mla_memcheck.log
st mla_racecheck 200 compute-sanitizer --tool racecheck --error-exitcode=1 $I/bin/attnserve_gpu_mla_tests --gtest_filter='*H128Ps16DecodeBf16*:*H128Ps64PrefillBf16*'
grep -E "PASSED|FAILED|RACECHECK SUMMARY" $O/l/mla_racecheck.log
st mla_server 150 env ATTNSERVE_BIN=$I/bin/attnserve ATTNSERVE_TEST_SERVER_FLAGS=--backend=cuda ATTNSERVE_TEST_MLA_WIDTHS=512,64 $I/bin/integration_test --gtest_filter='MlaServerTest.*:PageSizes/MlaPrefillTest.*'
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran" $O/l/mla_server.log | head -10
echo "== MLA server on CUDA, 128 heads, attnctl"
( $I/bin/attnserve --attention=mla --num_qo_heads=128 --num_layers=2 --listen=127.0.0.1:50061 --metrics_listen=127.0.0.1:9481 > $O/l/mla_srv.log 2>&1 & echo $! > /tmp/srv.pid )
for _ in $(seq 1 300); do grep -q "listening grpc=" $O/l/mla_srv.log && break; sleep 0.1; done
A=--target=127.0.0.1:50061
( timeout 60 $I/bin/attnctl $A prefill --batch=4 --q_len=1 --kv_len=4096; timeout 60 $I/bin/attnctl $A prefill --batch=2 --q_len=300 --kv_len=1000 ) 2>&1 | tee $O/l/mla_attnctl.txt | tail -6
python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:9481/metrics').read().decode())" | grep 'kernel_launches_total{' | tee -a $O/l/mla_attnctl.txt
kill -TERM $(cat /tmp/srv.pid); sleep 1
st mla_bench 120 $I/bin/attnserve_mla_bench
grep RESULT $O/l/mla_bench.log
st mla_torch 60 python3 bench/mla_torch.py
grep TORCH $O/l/mla_torch.log
fin
