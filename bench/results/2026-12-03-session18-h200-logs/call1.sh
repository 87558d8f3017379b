# r1: where the prefill and decode kernels stand against same-run cuDNN / FA2; the Python gRPC breakdown (HEAD 34645db)
source .gpu/common.sh
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench
B=$I/bin
st kb 120 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512,sweep_len1024 --page_sizes=1,16,64
st torch 150 python3 bench/torch_baselines.py --quick
st trace 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --trace=132
st dec 120 $B/attnserve_decode_bench --quick --only=decode_b256,decode_b8_128k,decode_b64
st tdec 120 python3 bench/torch_decode_baselines.py --quick
$B/attnserve --backend=cuda --num_layers=32 --num_pages=17000 --allow_shared_memory --metrics_listen=127.0.0.1:9464 > $O/l/server.log 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -q "listening grpc=" $O/l/server.log && break; sleep 0.1; done
st pyb 150 python3 bench/python_grpc_breakdown.py --device cuda --iters 200 --json $O/l/pyb.json --profile $O/l/pyb_profile.txt
kill -TERM $pid; wait $pid
fin
