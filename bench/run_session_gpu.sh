#!/usr/bin/env bash
# One GPU-machine session for the serving work: the GPU tests (kernels,
# backend, server against CPU server and float64 reference), what server
# plans save per decode step (bench/plans.py), and the Llama-style model with
# its attention local and on attnserve (examples/llama.py). Logs go to OUT.
#   bench/run_session_gpu.sh INSTALL_DIR OUT
# INSTALL_DIR: `cmake --install build --prefix DIR` plus attnserve_gpu_kernel_tests
# and attnserve_gpu_server_tests copied into DIR/bin.
set -u
inst=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
export PYTHONPATH=$PWD/client/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /'
python3 -c 'import torch, grpc, google.protobuf as p, numpy; print("torch", torch.__version__, "grpcio", grpc.__version__, "protobuf", p.__version__, "numpy", numpy.__version__)'

echo "== kernel and backend tests"
LD_LIBRARY_PATH="$inst/lib" timeout 240 "$inst/bin/attnserve_gpu_kernel_tests" > "$out/kernel_tests.txt" 2>&1
echo "exit $?"; grep -E "^\[  (PASSED|FAILED) |Failure" "$out/kernel_tests.txt" | head -20

echo "== server-level GPU tests"
timeout 240 bash bench/run_server_gpu.sh "$inst" "$out/server" > "$out/server_run.txt" 2>&1
echo "exit $?"; grep -E "^\[  (PASSED|FAILED) |OK$|FAILED|MISSING" "$out/server/server_gpu_tests.txt" "$out/server/attnctl.txt" | head -20

echo "== CUDA server: 32 layers"
"$inst/bin/attnserve" --backend=cuda --num_layers=32 --num_pages=17000 --metrics_listen=127.0.0.1:9464 \
  > "$out/server.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -q "listening grpc=" "$out/server.log" && break; sleep 0.1; done
head -2 "$out/server.log"

echo "== plans: decode64 over 4096 keys, 32 layers per step"
timeout 200 python3 bench/plans.py --layers 32 --steps 20 --json "$out/plans.json" 2>&1 | tail -8

echo "== llama, realistic widths, 32 layers: local, server (plans), ping-pong"
timeout 240 python3 examples/llama.py --preset realistic --layers 32 --device cuda \
  --json "$out/llama.json" > "$out/llama.txt" 2>&1
echo "exit $?"; tail -15 "$out/llama.txt"
echo "== llama: server without plans"
timeout 120 python3 examples/llama.py --preset realistic --layers 32 --device cuda \
  --attention kvmanager --no_server_plans --json "$out/llama_noplans.json" > "$out/llama_noplans.txt" 2>&1
echo "exit $?"; tail -6 "$out/llama_noplans.txt"
curl -s 127.0.0.1:9464/metrics > "$out/metrics.txt" 2>/dev/null || true
kill -TERM $pid; wait $pid; echo "server exit $?"
tail -2 "$out/server.log"
