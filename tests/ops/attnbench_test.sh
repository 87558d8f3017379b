#!/usr/bin/env bash
# attnbench against the CPU backend: short verified closed-loop runs (decode
# and prefill) and a short open-loop run; checks the exit code, the JSON's
# keys, the request count, that requests per launch was read from /metrics,
# and that a run that needs more KV pages than the server has free is
# refused up front with the numbers.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/ops/lib.sh"
ATTNBENCH=${ATTNBENCH:-$ROOT/build/bin/attnbench}
WORK=$(mktemp -d)
trap 'stop_server; rm -rf "$WORK"' EXIT

start_server || { echo "0 passed, 1 failed"; exit 1; }
bench() { "$ATTNBENCH" --target="$GRPC_ADDR" --metrics="$METRICS_ADDR" "$@" 2>"$WORK/stderr"; }
# json_check FILE REQUESTS: every key present, requests as asked, no errors,
# and a numeric mean_requests_per_launch.
json_check() {
  python3 - "$1" "$2" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ["workload", "mode", "concurrency", "requests", "ok", "elapsed_s", "requests_per_s",
        "query_rows_per_s", "tflops", "latency_ms", "errors", "errors_by_code",
        "wrong_results", "mean_requests_per_launch", "latencies_ms"]
missing = [k for k in keys if k not in r]
assert not missing, missing
assert set(r["latency_ms"]) == {"p50", "p90", "p99", "max"}, r["latency_ms"]
assert r["requests"] == int(sys.argv[2]) == r["ok"], (r["requests"], r["ok"])
assert r["errors"] == 0 and r["wrong_results"] == 0, r
assert isinstance(r["mean_requests_per_launch"], (int, float)) and r["mean_requests_per_launch"] >= 1, r
assert len(r["latencies_ms"]) == r["ok"] and r["requests_per_s"] > 0 and r["tflops"] > 0, r
# A decode request has one query row per sequence: --q_len is not reported.
assert (r["q_len"] is None) == (r["workload"] == "decode"), r["q_len"]
PY
}

for w in decode prefill; do
  bench --workload=$w --concurrency=4 --requests=40 --verify --batch=3 --q_len=16 --kv_len=64 \
    --json="$WORK/$w.json" >"$WORK/$w.out"
  check "$w closed loop, verified, exits 0" test $? -eq 0
  check "$w JSON has the keys and 40 requests" json_check "$WORK/$w.json" 40
  check "$w table reports requests per launch" grep -Eq "requests per launch: [0-9.]+$" "$WORK/$w.out"
done

# Attention variants on every request, with and without plans, verified; and
# attnctl's prefill with the same flags.
for plan in false true; do
  bench --workload=mixed --concurrency=2 --requests=12 --verify --batch=2 --q_len=24 --kv_len=160 \
    --window_left=40 --soft_cap=20 --sinks=random --plan=$plan --json="$WORK/variants_$plan.json" \
    >"$WORK/variants_$plan.out"
  check "window, soft-cap and sinks (--plan=$plan), verified, exit 0" test $? -eq 0
  check "... JSON has the keys and 12 requests" json_check "$WORK/variants_$plan.json" 12
done
ATTNCTL=${ATTNCTL:-$ROOT/build/bin/attnctl}
"$ATTNCTL" --target="$GRPC_ADDR" prefill --batch=3 --q_len=16 --kv_len=96 --window_left=8 \
  --soft_cap=5 --sinks=1.5 >"$WORK/attnctl.out" 2>&1
check "attnctl prefill with the variant flags, verified" grep -q "OK" "$WORK/attnctl.out"
"$ATTNCTL" --target="$GRPC_ADDR" prefill --sinks=0,1 >"$WORK/attnctl_bad.out" 2>&1
check "attnctl prefill with sinks of the wrong length exits non-zero" test $? -ne 0
check "... naming the field and the bound" grep -q "options.sinks has 2 entries, must have num_qo_heads" \
  "$WORK/attnctl_bad.out"

# 30 arrivals at 10/s: about 3 s, so the once-a-second progress line shows.
bench --workload=mixed --rate=10 --concurrency=4 --requests=30 --verify --batch=2 --q_len=16 \
  --kv_len=64 --json="$WORK/open.json" >"$WORK/open.out"
check "open loop, mixed, verified, exits 0" test $? -eq 0
check "open loop JSON has the keys and 30 requests" json_check "$WORK/open.json" 30
check "open loop JSON says open" grep -q '"mode": "open"' "$WORK/open.json"
check "progress line on stderr" grep -q "done [0-9]* .*req/s .*p99" "$WORK/stderr"

"$ATTNBENCH" --target="$GRPC_ADDR" --workload=decode --requests=5 --kv_len=32 >"$WORK/nometrics.out" 2>/dev/null
check "without --metrics: exit 0 and a note" grep -q "not measured (no --metrics)" "$WORK/nometrics.out"
check "decode banner shows batch and kv_len only" \
  grep -q "^attnbench: decode workload, batch=3 kv_len=64 (one query row per sequence), " "$WORK/decode.out"
# 4 clients x 64 pages (kv_len 1024, page_size 16) fill the 256-page server
# exactly: the two variants of a shape share their pages.
bench --workload=decode --concurrency=4 --requests=8 --verify --kv_len=1024 >"$WORK/full.out"
check "4 decode clients of 64 pages fit 256 pages, verified" test $? -eq 0
"$ATTNBENCH" --target="$GRPC_ADDR" --workload=decode --requests=5 --batch=999 --kv_len=4096 \
  >/dev/null 2>"$WORK/toobig.err"
check "a set-up the server cannot hold exits non-zero" test $? -ne 0
check "... and says why before allocating: pages needed, free, the flags to change" grep -q \
  "error: --concurrency=1 clients x 255744 KV pages each .* = 255744 pages, but the server has 256 of its 256 pages free: lower --concurrency, --batch or --kv_len .*--num_pages" \
  "$WORK/toobig.err"
check "every page freed afterwards" test "$(metric 'attnserve_kv_pages{state="used"}')" = 0
# Flags refused before anything connects (exit 2), each naming the flag.
for bad in "--rate=1e-300|--rate=1e-300 must be 0 (closed loop) or at least 0.001" \
           "--kv_dtype=foo|--kv_dtype=foo must be bf16, fp16, fp8_e4m3 or fp8_e5m2" \
           "--metrics=nonsense|--metrics=nonsense must be HOST:PORT" \
           "--json=$WORK|--json=$WORK: cannot be written"; do
  "$ATTNBENCH" --target="$GRPC_ADDR" --requests=1 "${bad%%|*}" >/dev/null 2>"$WORK/flag.err"
  rc=$?
  check "${bad%%|*}: exit 2" test $rc -eq 2
  check "... naming it" grep -qF -- "${bad#*|}" "$WORK/flag.err"
done
# An open loop whose next arrival falls past --duration_s still runs for it.
start_s=$(date +%s.%N)
"$ATTNBENCH" --target="$GRPC_ADDR" --workload=decode --rate=0.001 --duration_s=1 --kv_len=32 >"$WORK/slow.out" 2>/dev/null
check "an open loop at 0.001 requests/s exits 0" test $? -eq 0
check "... after its --duration_s" python3 -c "import sys, time; sys.exit(time.time() - $start_s < 0.9)"
# SIGTERM ends the run early; the clients release what they held and the
# report covers what ran (exit 130).
"$ATTNBENCH" --target="$GRPC_ADDR" --workload=decode --duration_s=30 --kv_len=64 >"$WORK/term.out" 2>"$WORK/term.err" &
bench_pid=$!
for _ in $(seq 1 100); do grep -q "done [0-9]" "$WORK/term.err" && break; sleep 0.05; done
kill -TERM $bench_pid
wait $bench_pid
check "SIGTERM: exit 130" test $? -eq 130
check "... with the report of what ran" grep -q "^requests: " "$WORK/term.out"
check "... and every page freed" test "$(metric 'attnserve_kv_pages{state="used"}')" = 0
# An open loop waiting for its next arrival (or for its end) ends on SIGTERM
# at once, not at the arrival.
"$ATTNBENCH" --target="$GRPC_ADDR" --workload=decode --rate=0.001 --duration_s=60 --kv_len=64 >/dev/null 2>&1 &
bench_pid=$!
sleep 1.5
start_s=$(date +%s)
kill -TERM $bench_pid
wait $bench_pid
rc=$?
check "SIGTERM of a waiting open loop: exit 130" test $rc -eq 130
check "... within seconds" test $(( $(date +%s) - start_s )) -le 5
check "... and every page freed" test "$(metric 'attnserve_kv_pages{state="used"}')" = 0
finish
