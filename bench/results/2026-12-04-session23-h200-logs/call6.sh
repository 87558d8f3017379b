# session 23 call 6: under an MPS control daemon, the layer bench (1-layer server) and the realistic model (32 layers)
source .gpu/common.sh
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/bench
srv() { tag=$1; bin=$2; shift 2; $I/bin/$bin --backend=cuda --allow_shared_memory --metrics_listen=127.0.0.1:9464 "$@" > $O/l/server_$tag.log 2>&1 & pid=$!; for _ in $(seq 1 300); do grep -q "listening grpc=" $O/l/server_$tag.log && break; sleep 0.1; done; }
stop() { kill -TERM $pid; wait $pid; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d || { echo "no MPS"; fin; exit 1; }
sleep 1
srv l1 attnserve_old --num_layers=1 --num_pages=17000
st L_mps_default 150 python3 bench/flashinfer_layer.py --device cuda --iters 500 --transports grpc,channel,cuda --json $O/l/L_mps_default.json
stop
srv l1spin attnserve_old --num_layers=1 --num_pages=17000 --idle_spin_us=2000 --channel_spin_us=2000
st L_mps_spin 150 python3 bench/flashinfer_layer.py --device cuda --iters 500 --transports grpc,channel,cuda --spin_us 2000 --json $O/l/L_mps_spin.json
stop
srv model attnserve_old --num_layers=32 --num_pages=17000
st llama_mps_cuda 150 python3 examples/llama.py --preset realistic --layers 32 --device cuda --batch 64 --attention local,server --transport cuda --json $O/l/llama_mps_cuda.json
st llama_mps_grpc 120 python3 examples/llama.py --preset realistic --layers 32 --device cuda --batch 64 --attention server --transport grpc --json $O/l/llama_mps_grpc.json
stop
echo quit | nvidia-cuda-mps-control; sleep 2
pgrep -a nvidia-cuda-mps || echo "no mps process left"
for f in $O/l/L_*.log; do echo "$(basename $f)"; grep "round trip" $f | cut -c1-330; done
grep -h '"mode"\|identical' $O/l/llama_*.log
fin
