# session 23 call 4: the server's stages for the C++ channel client (CUDA region) and the Python one, same server
source .gpu/common.sh
NEWPY=$PWD/client/python
srv() { tag=$1; bin=$2; shift 2; $I/bin/$bin --backend=cuda --allow_shared_memory --metrics_listen=127.0.0.1:9464 "$@" > $O/l/server_$tag.log 2>&1 & pid=$!; for _ in $(seq 1 300); do grep -q "listening grpc=" $O/l/server_$tag.log && break; sleep 0.1; done; }
stop() { kill -TERM $pid; wait $pid; }
AB="$I/bin/attnbench --target=127.0.0.1:50051 --workload=decode --batch=64 --kv_len=4096 --concurrency=1 --shm --plan"
for spin in 0 2000; do
  srv s$spin attnserve_old --num_layers=1 --num_pages=17000 --idle_spin_us=$spin --channel_spin_us=$([ $spin = 0 ] && echo 200 || echo 2000)
  for rep in 1 2; do
    st C_cudach_s${spin}_$rep 100 python3 .gpu/stages.py $AB --cuda_device=0 --channel --requests=500
    st C_cudach_busy_s${spin}_$rep 100 python3 .gpu/stages.py $AB --cuda_device=0 --channel --busy_poll --requests=500
    PYTHONPATH=$NEWPY:$PWD/bench st P_cuda_s${spin}_$rep 100 python3 bench/flashinfer_layer.py --device cuda --iters 500 --transports cuda --spin_us 2000
  done
  stop
done
for f in $O/l/C_*.log; do echo "$(basename $f)"; grep -E "latency ms|requests .* server mean" $f; done
for f in $O/l/P_*.log; do echo "$(basename $f)"; grep "round trip" $f | cut -c1-330; done
fin
