#!/usr/bin/env bash
# On a host with two GPUs: one attnserve per GPU (CUDA_VISIBLE_DEVICES=0 and 1)
# (docs/cluster.md, "Measured"):
#  (a) bench/cluster_bench.py (Python): one 32k-token causal prefill on one
#      GPU and spread over two (even and work-balanced split points): device
#      time on the critical path from each server's /metrics, and the merge of
#      the two partial states timed apart for each place it can run (numpy,
#      torch on the CPU, torch on the client's GPU, the server's MergeStates
#      over gRPC); the sum against one GPU; the same prefill through
#      attnserve.Cluster (numpy and GPU outputs);
#  (b) bin/cluster_decode_bench (C++ clients: the Python clients were
#      CPU-bound): 32 client threads, each with its own Cluster and its own
#      sequences of 4096 keys, one decode step run again and again (the
#      cache does not grow); one fresh server, then two fresh servers with the
#      same flags, at the same request size: 128 sequences per client request
#      (the issue's target), then 4 (cluster_bench.py's earlier part (b): 128
#      sequences over the 32 clients). Requests/s after a warmup, latency, the
#      client's CPU, and each server's sequences, Prefills, batches, kernel
#      time and queue wait over the timed window. After each timed run, a
#      short run of 2 clients checks every response against the float64
#      reference on the same servers.
# Ends with the scaling table of the run (scaling.md, also in cluster.txt).
# About 5 minutes on a 2xH200 host; logs and JSON go to OUT_DIR.
#   bench/run_cluster_gpu.sh INSTALL_DIR OUT_DIR [--smoke]
# INSTALL_DIR: `cmake --install build --prefix DIR`. Needs python3 with numpy
# and grpcio (torch, with CUDA, for bf16 tensors and the torch merges); run
# from the repository root (the Python client comes from client/python).
# --smoke: CPU servers at tiny sizes, to check the script on any machine
# (its numbers mean nothing).
set -uo pipefail
inst=$(cd "$1" && pwd)
out=$2
smoke=${3:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/client/python PYTHONUNBUFFERED=1
log=$out/cluster.txt
: >"$log"

if [[ "$smoke" == --smoke ]]; then
  backend=cpu
  py_args=(--backend cpu --prefill_len 512 --reps 2 --seqs 8 --kv_len 256 --clients 4)
  clients=4 kv_len=256 batches=(8 2) warmup_s=0.5 duration_s=2
else
  [[ -z "$smoke" ]] || { echo "usage: $0 INSTALL_DIR OUT_DIR [--smoke]"; exit 2; }
  backend=cuda
  py_args=(--prefill_len 32768 --reps 3 --seqs 128 --kv_len 4096 --clients 32)
  clients=32 kv_len=4096 batches=(128 4) warmup_s=3 duration_s=12
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
fi
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /' | tee "$out/commit.txt"
python3 -c 'import grpc, numpy; print("grpcio", grpc.__version__, "numpy", numpy.__version__)' 2>&1 |
  tee "$out/python.txt"
python3 -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1 | tee -a "$out/python.txt"
start=$(date +%s)
status=0

# ------------------------------------------------------------------ (a)
timeout -k 10 200 python3 bench/cluster_bench.py --bin "$inst/bin/attnserve" --devices 0,1 \
  "${py_args[@]}" --skip decode --out "$out" --json "$out/cluster.json" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "(a) cluster_bench exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
(( rc == 0 )) || status=1

# ------------------------------------------------------------------ (b)
# Every server: the same flags, room for every sequence of the largest run on
# one server, ports of its choosing.
page_size=16
num_pages=$(( clients * batches[0] * ((kv_len + page_size - 1) / page_size) + 1024 ))
server_flags=(--listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --backend=$backend --num_layers=1
  --num_pages=$num_pages --page_size=$page_size --max_message_bytes=1073741824)
echo "(b) servers: ${server_flags[*]} (fresh servers for each configuration)" | tee -a "$log"
PIDS=()
stop_servers() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  PIDS=()
}
trap stop_servers EXIT
trap 'exit 143' TERM INT
# start_servers N TAG: N servers on devices 0..N-1; sets TARGETS and METRICS
# (HOST:PORT lists). Not in a pipeline: PIDS must stay in this shell.
start_servers() {
  local n=$1 tag=$2 i slog grpc=() metrics=()
  for (( i = 0; i < n; i++ )); do
    slog=$out/server$i-$tag.log
    CUDA_VISIBLE_DEVICES=$i "$inst/bin/attnserve" "${server_flags[@]}" >"$slog" 2>&1 &
    PIDS+=($!)
  done
  for (( i = 0; i < n; i++ )); do
    slog=$out/server$i-$tag.log
    for _ in $(seq 1 600); do  # 300 s: CUDA start-up and the KV pool
      grep -q "listening grpc=" "$slog" && break
      kill -0 "${PIDS[$i]}" 2>/dev/null || break
      sleep 0.5
    done
    if ! grep -q "listening grpc=" "$slog"; then
      echo "server $i ($tag) did not start: see $slog" | tee -a "$log"
      return 1
    fi
    grpc+=("$(grep -o "grpc=[^ ]*" "$slog" | head -1 | cut -d= -f2)")
    metrics+=("$(grep -o "metrics=[^ ]*" "$slog" | head -1 | cut -d= -f2)")
  done
  TARGETS=$(IFS=,; echo "${grpc[*]}")
  METRICS=$(IFS=,; echo "${metrics[*]}")
}
for batch in "${batches[@]}"; do
  for n in 1 2; do
    tag=decode$n-b$batch
    echo "(b) $n server(s), $clients clients x $batch sequences over $kv_len keys" | tee -a "$log"
    if ! start_servers "$n" "$tag"; then
      status=1
      stop_servers
      continue
    fi
    timeout -k 10 300 "$inst/bin/cluster_decode_bench" --targets="$TARGETS" --metrics="$METRICS" \
      --clients=$clients --batch=$batch --kv_len=$kv_len --warmup_s=$warmup_s \
      --duration_s=$duration_s --timeout_s=120 --json="$out/$tag.json" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    (( rc == 0 )) || { status=1; echo "(b) $tag: exit $rc" | tee -a "$log"; }
    timeout -k 10 120 "$inst/bin/cluster_decode_bench" --targets="$TARGETS" --clients=2 --batch=8 \
      --kv_len=$kv_len --warmup_s=0 --duration_s=1 --timeout_s=120 --verify \
      --json="$out/verify-$tag.json" >"$out/verify-$tag.txt" 2>&1
    rc=$?
    echo "(b) $tag: verified run (2 clients x 8 sequences, every response against the float64" \
      "reference) exit $rc: $(grep '^errors:' "$out/verify-$tag.txt")" | tee -a "$log"
    (( rc == 0 )) || status=1
    stop_servers
  done
done

# ------------------------------------------------------------------ table
python3 - "$out" "$clients" "$kv_len" "${batches[@]}" <<'PY' 2>&1 | tee "$out/scaling.md" | tee -a "$log"
import json, os, sys
sys.path.insert(0, "bench")
import cluster_bench  # the (a) rows

out, clients, kv_len, batches = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def load(path):
    try:
        return json.load(open(os.path.join(out, path)))
    except (OSError, ValueError):
        return None
results = load("cluster.json") or {}
cluster_bench.scaling_table(results, sys.stdout)   # header, then (a)
for b in batches:
    one, two = load(f"decode1-b{b}.json"), load(f"decode2-b{b}.json")
    name = (f"decode, {clients} C++ clients x {b} sequences over {kv_len} keys "
            f"({int(clients) * int(b)} sequences)")
    if not one or not two:
        print(f"| {name}, requests/s | {one and one['requests_per_s']} | "
              f"{two and two['requests_per_s']} | (a run failed) | >= 1.7x |")
        continue
    ratio = two["requests_per_s"] / one["requests_per_s"] if one["requests_per_s"] else 0
    print(f"| {name}, requests/s | {one['requests_per_s']:.1f} | {two['requests_per_s']:.1f} | "
          f"{ratio:.2f}x | {'>= 1.7x' if b == batches[0] else ''} |")
    lat = lambda r: f"{r['latency_ms']['p50']} / {r['latency_ms']['p99']} ms"  # noqa: E731
    print(f"| same, p50 / p99 latency | {lat(one)} | {lat(two)} | | |")
    busy = lambda r: " + ".join(  # noqa: E731
        f"{100 * s['metrics']['device_busy']:.0f}%" if s.get("metrics") else "?"
        for s in r["per_server"])
    print(f"| same, device busy (kernel time / wall) | {busy(one)} | {busy(two)} | | |")
    cpu = lambda r: f"{r['client_cpu_ms_per_request']:.3f} ms ({r['client_cpu_cores']:.1f} cores)"  # noqa: E731
    print(f"| same, client process CPU per request | {cpu(one)} | {cpu(two)} | | |")
PY
echo "run_cluster_gpu.sh exit $status after $(( $(date +%s) - start )) s" | tee -a "$log"
exit "$status"
