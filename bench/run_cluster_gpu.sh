#!/usr/bin/env bash
# On a host with two GPUs: one attnserve per GPU (CUDA_VISIBLE_DEVICES=0 and 1)
# and bench/cluster_bench.py against them (docs/cluster.md, "Measured"):
#  (a) one 32k-token causal prefill on one GPU and spread over two (even and
#      work-balanced split points): device time on the critical path from each
#      server's /metrics, and the merge of the two partial states timed apart
#      for each place it can run (numpy, torch on the CPU, torch on the
#      client's GPU, the server's MergeStates over gRPC); the sum against one
#      GPU; the same prefill through attnserve.Cluster (numpy and GPU outputs);
#  (b) decode of 128 sequences over 4k keys, 32 client processes, one fresh
#      server and then two fresh servers with the same flags: requests/s
#      after a warmup, latency, and each server's batches, kernel time and
#      queue wait over the timed window.
# Ends with the scaling table (also in cluster.txt). Takes about 3 minutes
# on a 2xH200 host (the bench is stopped at 225 s); logs and JSON go to OUT_DIR.
#   bench/run_cluster_gpu.sh INSTALL_DIR OUT_DIR
# INSTALL_DIR: `cmake --install build --prefix DIR`. Needs python3 with numpy
# and grpcio (torch, with CUDA, for bf16 tensors and the torch merges); run
# from the repository root (the Python client comes from client/python).
set -uo pipefail
inst=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/client/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /' | tee "$out/commit.txt"
python3 -c 'import torch, grpc, numpy; print("torch", torch.__version__, "grpcio", grpc.__version__, "numpy", numpy.__version__)' 2>&1 | tee "$out/python.txt"

start=$(date +%s)
timeout -k 10 225 python3 bench/cluster_bench.py --bin "$inst/bin/attnserve" --devices 0,1 \
  --prefill_len 32768 --reps 3 --seqs 128 --kv_len 4096 --clients 32 --warmup 3 --duration 12 \
  --out "$out" --json "$out/cluster.json" 2>&1 | tee "$out/cluster.txt"
rc=${PIPESTATUS[0]}
echo "cluster_bench exit $rc after $(( $(date +%s) - start )) s" | tee -a "$out/cluster.txt"
exit "$rc"
