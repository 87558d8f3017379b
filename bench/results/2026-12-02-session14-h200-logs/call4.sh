source .gpu/common.sh
st run_mla 500 bash bench/run_mla_gpu.sh $I $O/l/mla
cat $O/l/mla/summary.txt
grep -B3 -A10 "Failure" $O/l/mla/*.log | head -40
echo "== MLA server on CUDA, 128 heads, attnctl"
( $I/bin/attnserve --attention=mla --num_qo_heads=128 --num_layers=2 --listen=127.0.0.1:50061 --metrics_listen=127.0.0.1:9481 > $O/l/mla_srv.log 2>&1 & echo $! > /tmp/srv.pid )
for _ in $(seq 1 300); do grep -q "listening grpc=" $O/l/mla_srv.log && break; sleep 0.1; done
head -3 $O/l/mla_srv.log
A=--target=127.0.0.1:50061
( timeout 30 $I/bin/attnctl $A info; timeout 60 $I/bin/attnctl $A prefill --batch=4 --q_len=1 --kv_len=4096; timeout 60 $I/bin/attnctl $A prefill --batch=2 --q_len=300 --kv_len=1000 ) 2>&1 | tee $O/l/mla_attnctl.txt
python3 -c "import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:9481/metrics').read().decode())" | grep 'kernel_launches_total{' | tee -a $O/l/mla_attnctl.txt
kill -TERM $(cat /tmp/srv.pid); sleep 1; tail -2 $O/l/mla_srv.log
fin
