# s38 c3: the final host code on a GPU: the server-level GPU tests (the read sweeper, the ring check of
# outputs, the clients' geometry check), the FlashInfer CUDA pytest file, test_edge_bounds and
# test_errors' geometry tests against a CUDA server, and attnbench (its clients now under leases) verified
# against a CUDA server, then ended by SIGTERM: exit 130, every page freed.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 170 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
ATTNSERVE_BIN=$B/attnserve ATTNSERVE_TEST_BACKEND=cuda st py_edge 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_edge_bounds.py tests/python/test_errors.py -k "health or metrics or not_read or plans_hold or geometry"
$B/attnserve --listen=127.0.0.1:50071 --metrics_listen=127.0.0.1:50072 > $O/l/srv.log 2>&1 &
for i in $(seq 1 100); do $B/attnctl --target=127.0.0.1:50071 health > /dev/null 2>&1 && break; sleep 0.2; done
st attnctl_info 20 $B/attnctl --target=127.0.0.1:50071 info
st bench_verify 60 $B/attnbench --target=127.0.0.1:50071 --workload=mixed --concurrency=4 --requests=40 --verify --kv_len=512
( $B/attnbench --target=127.0.0.1:50071 --workload=decode --duration_s=30 --kv_len=512 > $O/l/bench_term.log 2>&1; echo "rc=$?" >> $O/l/bench_term.log ) &
sleep 4; pkill -TERM -f "attnbench --target=127.0.0.1:50071 --workload=decode --duration_s=30"; sleep 3
st holdings 20 $B/attnctl --target=127.0.0.1:50071 holdings
st info_after 20 $B/attnctl --target=127.0.0.1:50071 info
kill %1 2>/dev/null; sleep 1
grep -h "passed\|failed" $O/l/py_fi_cuda.log $O/l/py_edge.log | tail -6
tail -3 $O/l/server.log; tail -4 $O/l/bench_term.log; grep -h "free_pages\|num_pages\|unleased" $O/l/holdings.log $O/l/info_after.log
fin
