#!/usr/bin/env bash
# Runs the decode kernel family's GPU tests, its benchmark, the PyTorch SDPA
# baselines, and the server end to end (attnserve --backend=cuda with
# --decode_kernel=auto and =off, attnbench decode 64 x 1 over 4096) on this
# machine's GPU, one after the other (never concurrently), and prints a
# summary last. Under 5 minutes on an H200: the steps are capped at
# 70 + 50 + 75 + 25 + 2 x 40 s = 300 s (attnbench filling 1 GiB of KV
# included); expected about 3 minutes.
#
# Usage: bench/run_decode_gpu.sh INSTALL_DIR OUT_DIR
#   INSTALL_DIR: cmake --install build --prefix INSTALL_DIR (bin/attnserve,
#     bin/attnbench, lib/) and
#     cmake --install build --prefix INSTALL_DIR --component decode_gpu
#     (bin/attnserve_gpu_decode_tests, bin/attnserve_decode_bench,
#     bin/attnserve_gpu_kernel_tests: its CudaBackend decode tests run here)
#   OUT_DIR receives device.txt, decode_tests.log, backend_tests.log, decode_bench.log,
#     torch_decode.log, server_{auto,off}.log, attnbench_{auto,off}.log,
#     metrics_{auto,off}.txt and summary.txt.
# Run from the repository root or anywhere: the torch script is found next to
# this file. SERVER_BACKEND=cpu ATTNBENCH_REQUESTS=2 ATTNBENCH_KV_LEN=256
# dry-runs the server part without a GPU.
set -u
if [[ $# -ne 2 ]]; then
  echo "usage: $0 INSTALL_DIR OUT_DIR" >&2
  exit 2
fi
inst=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$inst/lib:${LD_LIBRARY_PATH:-}"
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader \
  | tee "$out/device.txt"
git -C "$here" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /' | tee -a "$out/device.txt"

echo "== decode kernel tests"
timeout 70 "$inst/bin/attnserve_gpu_decode_tests" > "$out/decode_tests.log" 2>&1
rc=$?
echo "tests exit code: $rc" | tee -a "$out/decode_tests.log"
[[ $rc -ne 0 ]] && status=1
if grep -q "^\[  SKIPPED \]" "$out/decode_tests.log"; then
  echo "tests were SKIPPED (no GPU visible?)" | tee -a "$out/decode_tests.log"
  status=1
fi
grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|^\[       OK \]|^\[  FAILED  \]|Failure|error" "$out/decode_tests.log" | head -40

echo "== CUDA backend tests (decode and mixed batches through CudaBackend)"
if [[ -x "$inst/bin/attnserve_gpu_kernel_tests" ]]; then
  timeout 50 "$inst/bin/attnserve_gpu_kernel_tests" \
    --gtest_filter='CudaBackend.DecodeAndMixed*:CudaBackend.LongKv*' > "$out/backend_tests.log" 2>&1
  rc=$?
  echo "backend tests exit code: $rc" | tee -a "$out/backend_tests.log"
  [[ $rc -ne 0 ]] && status=1
  grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|^\[  FAILED  \]|Failure" "$out/backend_tests.log" | head -20
else
  echo "no bin/attnserve_gpu_kernel_tests (install the decode_gpu component)"; status=1
fi

echo "== decode bench"
timeout 75 "$inst/bin/attnserve_decode_bench" ${DECODE_BENCH_ARGS:-} > "$out/decode_bench.log" 2>&1
rc=$?
echo "bench exit code: $rc" | tee -a "$out/decode_bench.log"
[[ $rc -ne 0 ]] && status=1

echo "== torch decode baselines"
timeout 40 python3 "$here/torch_decode_baselines.py" ${TORCH_ARGS:-} > "$out/torch_decode.log" 2>&1
rc=$?
echo "torch exit code: $rc" | tee -a "$out/torch_decode.log"
grep -E "^torch|failed" "$out/torch_decode.log" | head -5

# ---- Server end to end: the same decode load with the decode family on and
# off; the server's attention kernel time per request from /metrics.
server_run() {  # $1: auto | off
  local mode=$1 log="$out/server_$1.log" pid addr maddr
  "$inst/bin/attnserve" --backend="${SERVER_BACKEND:-cuda}" --decode_kernel="$mode" --listen=127.0.0.1:0 \
    --metrics_listen=127.0.0.1:0 --num_layers=1 --page_size=16 --num_pages=20000 \
    --num_qo_heads=32 --num_kv_heads=4 --head_dim=128 --kv_dtype=bf16 >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do grep -q "listening grpc=" "$log" && break; sleep 0.05; done
  addr=$(grep -o "grpc=[^ ]*" "$log" | head -1 | cut -d= -f2)
  maddr=$(grep -o "metrics=[^ ]*" "$log" | head -1 | cut -d= -f2)
  if [[ -z "$addr" ]]; then
    echo "server ($mode) did not start:"; tail -5 "$log"; kill "$pid" 2>/dev/null; status=1; return
  fi
  timeout 40 "$inst/bin/attnbench" --target="$addr" --metrics="$maddr" --workload=decode --batch=64 \
    --kv_len="${ATTNBENCH_KV_LEN:-4096}" --concurrency=1 --requests="${ATTNBENCH_REQUESTS:-300}" --json="$out/attnbench_$mode.json" \
    >"$out/attnbench_$mode.log" 2>&1 || { echo "attnbench ($mode) failed"; status=1; }
  python3 -c 'import sys,urllib.request; print(urllib.request.urlopen("http://"+sys.argv[1]+"/metrics", timeout=5).read().decode())' \
    "$maddr" > "$out/metrics_$mode.txt" 2>&1 || echo "metrics ($mode) not read"
  kill -TERM "$pid"; wait "$pid" 2>/dev/null
}
echo "== server end to end (decode 64 x 1 over 4096, page_size 16)"
if [[ -x "$inst/bin/attnserve" && -x "$inst/bin/attnbench" ]]; then
  server_run auto
  server_run off
else
  echo "no bin/attnserve or bin/attnbench in $inst (cmake --install build --prefix $inst)"; status=1
fi

python3 - "$out" <<'PY' | tee "$out/summary.txt"
import os, re, sys
d = sys.argv[1]
def kv(line):
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}
dec, pre, nos, torch_ = {}, {}, {}, {}
copy = None
for line in open(os.path.join(d, "decode_bench.log"), errors="replace"):
    if line.startswith("RESULT kernel=decode "):
        r = kv(line); dec[(r["workload"], r["page_size"])] = r
    elif line.startswith("RESULT kernel=decode_nosplit"):
        r = kv(line); nos[(r["workload"], r["page_size"])] = r
    elif line.startswith("RESULT kernel=prefill"):
        r = kv(line); k = (r["workload"], r["page_size"])
        if k not in pre or float(r["ms"]) < float(pre[k]["ms"]): pre[k] = r
    elif line.startswith("RESULT kernel=copy"):
        copy = kv(line)
tp = os.path.join(d, "torch_decode.log")
if os.path.exists(tp):
    for line in open(tp, errors="replace"):
        if line.startswith("TORCH"):
            r = kv(line); torch_[(r["workload"], r["backend"])] = r
if copy: print(f'copy ceiling (D2D 1 GiB, read+write): {float(copy["tbs"]):.2f} TB/s')
print("ms: each launch timed on an idle device (host launch latency included); queued: behind a spin kernel (device time alone)")
print("| workload | ps | decode ms | TB/s | decode ms queued | TB/s queued | merge share | chunk | cluster | items | unsplit ms | prefill ms (best variant) | cuDNN ms (queued) | flash ms (queued) |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
def ms(r): return "-" if r is None else f'{float(r["ms"]):.4f}'
def msq(r):
    if r is None: return "-"
    return f'{float(r["ms"]):.4f}' + (f' ({float(r["ms_queued"]):.4f})' if "ms_queued" in r else "")
for (w, ps), r in dec.items():
    p = pre.get((w, ps)); n = nos.get((w, ps))
    pv = "-" if p is None else f'{float(p["ms"]):.4f} (v{p["variant"]})'
    q = f'{float(r["ms_queued"]):.4f} | {float(r["kv_tbs_queued"]):.2f}' if "ms_queued" in r else "- | -"
    print(f'| {w} | {ps} | {float(r["ms"]):.4f} | {float(r["kv_tbs"]):.2f} | {q} | {100*float(r["merge_share"]):.1f}% | '
          f'{r["chunk"]} | {r.get("cluster", "0")} | {r["items"]} | {ms(n)} | {pv} | {msq(torch_.get((w, "cudnn")))} | {msq(torch_.get((w, "fa2")))} |')
sweep = [kv(l) for l in open(os.path.join(d, "decode_bench.log"), errors="replace")
         if l.startswith("RESULT kernel=decode_chunk ")]
if sweep:
    print("\nchunk sweep (forced chunk lengths; the plan's choice is the table's 'chunk'):")
    for r in sweep:
        print(f'  {r["workload"]} chunk={r["chunk"]} items={r["items"]} ms={float(r["ms"]):.4f} TB/s={float(r["kv_tbs"]):.2f}')
csweep = [kv(l) for l in open(os.path.join(d, "decode_bench.log"), errors="replace")
          if l.startswith("RESULT kernel=decode_cluster ")]
if csweep:
    print("\ncluster sweep (forced cluster mode: chunks of a tile merged in distributed shared memory):")
    for r in csweep:
        print(f'  {r["workload"]} ps={r["page_size"]} cluster={r["cluster"]} chunk={r["chunk"]} items={r["items"]} ms={float(r["ms"]):.4f} TB/s={float(r["kv_tbs"]):.2f}')
# Server end to end: attention kernel time per request from /metrics.
def metric(text, name, labels=""):
    for line in text.splitlines():
        if line.startswith(name + ("{" + labels + "}" if labels else "")) or \
           (labels and line.startswith(name + "{") and labels in line):
            try: return float(line.split()[-1])
            except ValueError: pass
    return None
print("\nserver end to end, attnbench decode 64 x 1 over 4096 (page_size 16):")
print("| decode_kernel | requests | attention launches | decode launches | attention ms per batch | attention ms per request | client p50 ms |")
print("|---|---|---|---|---|---|---|")
for mode in ("auto", "off"):
    p = os.path.join(d, f"metrics_{mode}.txt")
    if not os.path.exists(p):
        print(f"| {mode} | (no metrics) | | | | | |"); continue
    t = open(p, errors="replace").read()
    # attention_prefill and attention_decode are disjoint: a batch's attention
    # is their sum (its batches: those with either).
    att_n = max(metric(t, "attnserve_kernel_duration_seconds_count", 'kernel="attention_prefill"'),
                metric(t, "attnserve_kernel_duration_seconds_count", 'kernel="attention_decode"'))
    att_s = (metric(t, "attnserve_kernel_duration_seconds_sum", 'kernel="attention_prefill"') +
             metric(t, "attnserve_kernel_duration_seconds_sum", 'kernel="attention_decode"'))
    dec = metric(t, "attnserve_kernel_launches_total", 'kernel="attention_decode"')
    launches = metric(t, "attnserve_kernel_launches_total", 'kernel="attention_prefill"') + dec
    reqs = metric(t, "attnserve_batch_requests_sum")
    p50 = "-"
    j = os.path.join(d, f"attnbench_{mode}.json")
    if os.path.exists(j):
        import json
        try:
            p50 = f'{float(json.load(open(j))["latency_ms"]["p50"]):.3f}'
        except Exception: pass
    per_batch = f"{1e3 * att_s / att_n:.4f}" if att_n else "-"
    per_req = f"{1e3 * att_s / reqs:.4f}" if reqs else "-"
    print(f"| {mode} | {reqs} | {launches} | {dec} | {per_batch} | {per_req} | {p50} |")
PY
echo "== summary table of the bench"
sed -n '/^copy ceiling/,$p' "$out/decode_bench.log"
exit $status
