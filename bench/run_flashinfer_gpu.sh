#!/usr/bin/env bash
# One GPU-machine run for attnserve.flashinfer (docs/flashinfer.md): the
# wrappers' CUDA tests against a CUDA-backend server (torch CUDA tensors,
# every transport), one layer's round trip by transport (decode 64 x 4096
# keys, bench/flashinfer_layer.py, against a one-layer server so that every
# layer of the cache is written, as in a running engine), and the realistic
# Llama-style model (examples/llama.py, 32 layers, batch 64, 128 decode
# steps) with local attention, then attnserve over the CUDA region +
# channel, over gRPC and over a system region + channel, the server's
# /metrics saved around each.
#   bench/run_flashinfer_gpu.sh INSTALL_DIR OUT
# INSTALL_DIR/bin/attnserve: a CUDA build (ATTNSERVE_SM90A_ONLY for an H200).
# MPS=1: run everything under an MPS control daemon started here and stopped
# at the end (the client's and the server's GPU work then share the GPU
# instead of taking turns: docs/transport.md, "One GPU, two processes").
# SERVER_ARGS: extra flags for both servers (e.g. --idle_spin_us=2000
# --channel_spin_us=2000).
set -u
if [ $# -ne 2 ]; then echo "usage: bench/run_flashinfer_gpu.sh INSTALL_DIR OUT" >&2; exit 2; fi
inst=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python${PYTHONPATH:+:$PYTHONPATH}
# pytest: the machine's, else the copy packed beside the repository (site/).
python3 -c "import pytest" 2>/dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/site
export PYTHONUNBUFFERED=1 LD_LIBRARY_PATH="$inst/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"
python3 -c 'import sys, torch, grpc, google.protobuf as p, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "grpcio", grpc.__version__, "protobuf", p.__version__, "numpy", numpy.__version__)' | tee -a "$out/device.txt"
metrics() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9464/metrics', timeout=10).read().decode())" > "$1"; }

if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/attnserve-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/attnserve-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "nvidia-cuda-mps-control -d failed" >&2; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  echo "== under an MPS control daemon"
fi

echo "== flashinfer wrappers with CUDA tensors, CUDA-backend server (pytest)"
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 ATTNSERVE_BIN="$inst/bin/attnserve" timeout 180 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/python/test_flashinfer_cuda.py > "$out/test_flashinfer_cuda.txt" 2>&1
echo "exit $?"; tail -15 "$out/test_flashinfer_cuda.txt"

serve() {  # LOG ARGS...: starts a CUDA server, sets pid
  local log=$1; shift
  # shellcheck disable=SC2086
  "$inst/bin/attnserve" --backend=cuda --num_pages=17000 --allow_shared_memory \
    --metrics_listen=127.0.0.1:9464 ${SERVER_ARGS:-} "$@" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do grep -q "listening grpc=" "$log" && break; sleep 0.1; done
  head -3 "$log"
}

echo "== one layer's round trip, decode 64 x 4096 keys (a one-layer CUDA server)"
serve "$out/server_layer.log" --num_layers=1
timeout 120 python3 bench/flashinfer_layer.py --transports grpc,channel,cuda --device cuda \
  --iters 500 --json "$out/layer.json" 2>&1 | tee "$out/layer.txt" | tail -4
kill -TERM $pid; wait $pid

echo "== CUDA server: 32 layers"
serve "$out/server.log" --num_layers=32

run_llama() {  # NAME ARGS...
  local name=$1; shift
  metrics "$out/metrics_before_$name.txt"
  timeout 150 python3 examples/llama.py --preset realistic --layers 32 --device cuda --batch 64 \
    --json "$out/llama_$name.json" "$@" > "$out/llama_$name.txt" 2>&1
  echo "exit $?"
  metrics "$out/metrics_after_$name.txt"
  grep -E '"mode"|vs local|FAILED|Error|error' "$out/llama_$name.txt" | tail -6
}
echo "== llama, realistic, batch 64: local, then attnserve over a CUDA region + channel"
run_llama cuda --attention local,server --transport cuda
echo "== llama: attnserve over gRPC"
run_llama grpc --attention server --transport grpc
echo "== llama: attnserve over a system region + channel"
run_llama channel --attention server --transport channel

kill -TERM $pid; wait $pid
echo "server exit $?"
