# session 23 call 2: the #31 server/client changes against the session's start, 1-layer server for the layer bench
source .gpu/common.sh
NEWPY=$PWD/client/python; OLDPY=$PWD/.gpu/old/client/python
export PYTHONPATH=$NEWPY:$PWD/examples:$PWD/bench:$PWD/tests/python:$PWD/.gpu/site
srv() { tag=$1; bin=$2; shift 2; $I/bin/$bin --backend=cuda --allow_shared_memory --metrics_listen=127.0.0.1:9464 "$@" > $O/l/server_$tag.log 2>&1 & pid=$!; for _ in $(seq 1 300); do grep -q "listening grpc=" $O/l/server_$tag.log && break; sleep 0.1; done; }
stop() { kill -TERM $pid; wait $pid; }
ATTNSERVE_BIN=$I/bin/attnserve st pytest_fi_cuda 150 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
lb() { name=$1; py=$2; shift 2; PYTHONPATH=$py:$PWD/bench st $name 120 python3 bench/flashinfer_layer.py --device cuda --json $O/l/$name.json "$@"; }
for rep in a b; do
srv old_$rep attnserve_old --num_layers=1 --num_pages=17000
lb L_old_$rep $OLDPY --transports grpc,channel,cuda
stop
srv new_$rep attnserve --num_layers=1 --num_pages=17000
lb L_new_$rep $NEWPY --transports grpc,channel,cuda
stop
done
srv oldspin attnserve_old --num_layers=1 --num_pages=17000 --idle_spin_us=2000 --channel_spin_us=2000
lb L_oldspin $NEWPY --transports cuda,channel --spin_us 2000
stop
srv newspin attnserve --num_layers=1 --num_pages=17000 --idle_spin_us=2000 --channel_spin_us=2000
lb L_newspin $NEWPY --transports cuda,channel,grpc --spin_us 2000 --profile $O/l/prof_newspin
stop
srv model attnserve --num_layers=32 --num_pages=17000
PYTHONPATH=$NEWPY:$PWD/examples st llama_grpc_new 170 python3 examples/llama.py --preset realistic --layers 32 --device cuda --batch 64 --attention local,server --transport grpc --json $O/l/llama_grpc_new.json
PYTHONPATH=$OLDPY:$PWD/examples st llama_grpc_old 120 python3 examples/llama.py --preset realistic --layers 32 --device cuda --batch 64 --attention server --transport grpc --json $O/l/llama_grpc_old.json
stop
grep -h "round trip" $O/l/L_*.log > $O/l/brief.txt; for f in $O/l/L_*.log; do echo "$f"; grep "round trip" $f | cut -c1-400; done
grep -h "tokens/s\|vs local" $O/l/llama_*.log | tail -12
tail -3 $O/l/pytest_fi_cuda.log
fin
