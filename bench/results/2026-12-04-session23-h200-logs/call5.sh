# session 23 call 5: the Python CUDA-region path with and without an MPS control daemon (contexts of client and server share the GPU)
source .gpu/common.sh
NEWPY=$PWD/client/python
srv() { tag=$1; bin=$2; shift 2; $I/bin/$bin --backend=cuda --allow_shared_memory --metrics_listen=127.0.0.1:9464 "$@" > $O/l/server_$tag.log 2>&1 & pid=$!; for _ in $(seq 1 300); do grep -q "listening grpc=" $O/l/server_$tag.log && break; sleep 0.1; done; }
stop() { kill -TERM $pid; wait $pid; }
AB="$I/bin/attnbench --target=127.0.0.1:50051 --workload=decode --batch=64 --kv_len=4096 --concurrency=1 --shm --plan"
which nvidia-cuda-mps-control | tee $O/l/mps_which.txt
runs() { tag=$1
  srv $tag attnserve_old --num_layers=1 --num_pages=17000 --idle_spin_us=2000 --channel_spin_us=2000
  for rep in 1 2; do
    st C_${tag}_$rep 100 python3 .gpu/stages.py $AB --cuda_device=0 --channel --requests=500
    PYTHONPATH=$NEWPY:$PWD/bench st P_${tag}_$rep 100 python3 bench/flashinfer_layer.py --device cuda --iters 500 --transports cuda --spin_us 2000
  done
  stop; }
runs nomps
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
if nvidia-cuda-mps-control -d; then
  sleep 1
  runs mps
  echo quit | nvidia-cuda-mps-control; sleep 2
  cp /tmp/mps_log/* $O/l/ 2>/dev/null
fi
unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
pgrep -a nvidia-cuda-mps || echo "no mps process left" | tee -a $O/l/mps_which.txt
for f in $O/l/C_*.log; do echo "$(basename $f)"; grep -E "latency ms|requests .* server mean" $f; done
for f in $O/l/P_*.log; do echo "$(basename $f)"; grep "round trip" $f | cut -c1-330; done
fin
