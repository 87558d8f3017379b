source .gpu/common.sh
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python
metrics() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=10).read().decode())" > "$1"; }
python3 -c 'import sys, torch, grpc, google.protobuf as p, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "grpcio", grpc.__version__, "protobuf", p.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
$I/bin/attnserve --backend=cuda --num_layers=32 --num_pages=17000 --allow_shared_memory --metrics_listen=127.0.0.1:9464 > $O/l/server.log 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -q "listening grpc=" $O/l/server.log && break; sleep 0.1; done
head -3 $O/l/server.log
for pass in a b; do
  PYTHONPATH=$PWD/.gpu/oldclient/client/python:$PWD/examples:$PWD/tests/python st layer_old_$pass 90 python3 bench/flashinfer_layer.py --transports grpc --device cuda --iters 200 --json $O/l/layer_old_$pass.json
  st layer_new_$pass 90 python3 bench/flashinfer_layer.py --transports grpc --device cuda --iters 200 --json $O/l/layer_new_$pass.json
  tail -1 $O/l/layer_old_$pass.log; tail -1 $O/l/layer_new_$pass.log
done
metrics $O/l/metrics_before_llama.txt
st llama_grpc 200 python3 examples/llama.py --preset realistic --layers 32 --device cuda --batch 64 --json $O/l/llama_grpc.json --attention local,server --transport grpc
metrics $O/l/metrics_after_llama.txt
grep -E '"mode"|vs local|tokens/s|FAILED|Error|error' $O/l/llama_grpc.log | tail -8
kill -TERM $pid; wait $pid
cat $O/l/summary.txt
fin
