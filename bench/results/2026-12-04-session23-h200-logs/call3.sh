# session 23 call 3: repeated A/B of the completer's idle spin (server) and of the pinned copies (Python gRPC path)
source .gpu/common.sh
NEWPY=$PWD/client/python; OLDPY=$PWD/.gpu/old/client/python
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
srv() { tag=$1; bin=$2; shift 2; $I/bin/$bin --backend=cuda --allow_shared_memory --metrics_listen=127.0.0.1:9464 "$@" > $O/l/server_$tag.log 2>&1 & pid=$!; for _ in $(seq 1 300); do grep -q "listening grpc=" $O/l/server_$tag.log && break; sleep 0.1; done; }
stop() { kill -TERM $pid; wait $pid; }
lb() { name=$1; py=$2; shift 2; PYTHONPATH=$py:$PWD/bench st $name 120 python3 bench/flashinfer_layer.py --device cuda --iters 500 --json $O/l/$name.json "$@"; }
PYTHONPATH=$NEWPY:$PWD/tests/python:$PWD/.gpu/site ATTNSERVE_BIN=$I/bin/attnserve st pytest_fi_cuda 150 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
for rep in 1 2 3; do
  srv oldspin$rep attnserve_old --num_layers=1 --num_pages=17000 --idle_spin_us=2000 --channel_spin_us=2000
  lb S_old_$rep $NEWPY --transports cuda,channel --spin_us 2000
  stop
  srv newspin$rep attnserve --num_layers=1 --num_pages=17000 --idle_spin_us=2000 --channel_spin_us=2000
  lb S_new_$rep $NEWPY --transports cuda,channel --spin_us 2000
  stop
done
srv grpcab attnserve --num_layers=1 --num_pages=17000
for rep in 1 2 3; do
  lb G_old_$rep $OLDPY --transports grpc
  lb G_new_$rep $NEWPY --transports grpc
done
stop
srv model attnserve --num_layers=32 --num_pages=17000
PYTHONPATH=$NEWPY:$PWD/examples st llama_grpc_new 150 python3 examples/llama.py --preset realistic --layers 32 --device cuda --batch 64 --attention local,server --transport grpc --json $O/l/llama_grpc_new.json
stop
for f in $O/l/S_*.log $O/l/G_*.log; do echo "$(basename $f)"; grep "round trip" $f | cut -c1-330; done
grep -h '"mode"' $O/l/llama_*.log
tail -3 $O/l/pytest_fi_cuda.log
fin
