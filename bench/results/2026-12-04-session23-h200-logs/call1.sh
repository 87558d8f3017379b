# session 23 call 1: where a Python layer call's time goes (issue #31)
source .gpu/common.sh
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/bench
S=$I/bin/attnserve
srv() { tag=$1; shift; $S --backend=cuda --num_layers=32 --num_pages=17000 --allow_shared_memory --metrics_listen=127.0.0.1:9464 "$@" > $O/l/server_$tag.log 2>&1 & pid=$!; for _ in $(seq 1 300); do grep -q "listening grpc=" $O/l/server_$tag.log && break; sleep 0.1; done; }
stop() { kill -TERM $pid; wait $pid; }
srv default
st layer_default_s50 150 python3 bench/flashinfer_layer.py --transports grpc,channel,cuda --device cuda --spin_us 50 --profile $O/l/prof_default_s50 --json $O/l/layer_default_s50.json
st layer_default_s2000 100 python3 bench/flashinfer_layer.py --transports channel,cuda --device cuda --spin_us 2000 --json $O/l/layer_default_s2000.json
stop
srv spin --idle_spin_us=2000 --channel_spin_us=2000
st layer_spin_s50 100 python3 bench/flashinfer_layer.py --transports cuda --device cuda --spin_us 50 --json $O/l/layer_spin_s50.json
st layer_spin_s2000 150 python3 bench/flashinfer_layer.py --transports grpc,channel,cuda --device cuda --spin_us 2000 --profile $O/l/prof_spin_s2000 --json $O/l/layer_spin_s2000.json
stop
$I/bin/attnecho --listen=127.0.0.1:50062 > $O/l/echo_server.log 2>&1 & epid=$!
sleep 1
st echo_cpu 60 python3 .gpu/echo.py 127.0.0.1:50062 cpu
st echo_cuda 60 python3 .gpu/echo.py 127.0.0.1:50062 cuda
st echo_cxx 60 $I/bin/attnbench --target=127.0.0.1:50062 --workload=decode --batch=64 --kv_len=16 --concurrency=1 --requests=300
kill $epid
grep -h "round trip\|echo\|latency" $O/l/*.log | tee $O/l/brief.txt
fin
