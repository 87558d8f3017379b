#!/usr/bin/env bash
# cluster_decode_bench against two CPU servers at small shapes: a verified
# run over both (JSON keys, every sequence placed, both servers used, their
# /metrics read, the cache still at --kv_len keys), the same over one server,
# a sequence too long for one server spread over both and still verified,
# every page freed afterwards, and bad flags refused with the field and
# the bound. About 10 s.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/ops/lib.sh"
BENCH=${CLUSTER_DECODE_BENCH:-$ROOT/build/bin/cluster_decode_bench}
WORK=$(mktemp -d)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; rm -rf "$WORK"' EXIT

# Two servers of 256 pages (lib.sh's flags: 2 layers, page_size 16, 8/2 heads of 64).
GRPC=() METRICS=()
for i in 0 1; do
  start_server || { echo "0 passed, 1 failed"; exit 1; }
  PIDS+=("$SERVER_PID") GRPC+=("$GRPC_ADDR") METRICS+=("$METRICS_ADDR")
done
TWO="${GRPC[0]},${GRPC[1]}"

# json_check FILE SERVERS SEQUENCES KV_LEN [SPREAD]: the keys, no error, every
# request OK, every sequence placed, the cache at KV_LEN keys, and (SPREAD
# unset) no sequence spread and every server's /metrics read.
json_check() {
  python3 - "$@" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
servers, seqs, kv_len = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
spread = len(sys.argv) > 5
keys = ["targets", "servers", "clients", "batch", "kv_len", "requests", "ok", "requests_per_s",
        "prefill_rpcs_per_s", "sequences_per_s", "latency_ms", "errors", "errors_by_code",
        "wrong_results", "warmup_errors", "kv_len_at_end", "spread_sequences",
        "client_cpu_ms_per_request", "per_server", "verify"]
missing = [k for k in keys if k not in r]
assert not missing, missing
assert set(r["latency_ms"]) == {"p50", "p90", "p99", "max"}, r["latency_ms"]
assert r["verify"] is True, r
assert r["requests"] == r["ok"] > 0 and r["requests_per_s"] > 0, r
assert r["errors"] == 0 and r["wrong_results"] == 0 and r["warmup_errors"] == 0, r
assert r["servers"] == servers == len(r["per_server"]), r
assert r["kv_len_at_end"] == kv_len == r["kv_len"], r
placed = sum(s["sequences"] for s in r["per_server"])
if spread:
    assert r["spread_sequences"] >= 1 and placed > seqs, r
else:
    assert r["spread_sequences"] == 0 and placed == seqs, r
    for s in r["per_server"]:
        assert s["sequences"] > 0 and s["prefill_rpcs_per_s"] > 0, s
        assert s["metrics"] and s["metrics"]["batches_per_s"] > 0, s
    # One Prefill per server touched per request.
    assert abs(r["prefill_rpcs_per_s"] - servers * r["requests_per_s"]) < 1e-6 * r["prefill_rpcs_per_s"], r
PY
}

"$BENCH" --targets="$TWO" --metrics="${METRICS[0]},${METRICS[1]}" --clients=2 --batch=3 \
  --kv_len=70 --layer=1 --warmup_s=0.3 --duration_s=1 --verify --json="$WORK/two.json" \
  >"$WORK/two.out" 2>"$WORK/two.err"
check "two servers: verified run exits 0" test $? -eq 0
check "two servers: JSON, placement, /metrics, 70 keys at the end" json_check "$WORK/two.json" 2 6 70
check "two servers: per-server lines" grep -q "^server 1 ${GRPC[1]}: .* sequences .*/metrics: " "$WORK/two.out"

"$BENCH" --targets="${GRPC[0]}" --metrics="${METRICS[0]}" --clients=2 --batch=3 --kv_len=70 \
  --warmup_s=0 --duration_s=1 --verify --server_plans --json="$WORK/one.json" >"$WORK/one.out" 2>&1
check "one server, server plans: verified run exits 0" test $? -eq 0
check "one server: JSON, every sequence there" json_check "$WORK/one.json" 1 6 70

# 4200 keys are 263 pages: more than one server's 256, so the sequence is
# spread over both and each response merged from two servers.
"$BENCH" --targets="$TWO" --clients=1 --batch=1 --kv_len=4200 --warmup_s=0 --duration_s=0.5 \
  --verify --json="$WORK/spread.json" >"$WORK/spread.out" 2>&1
check "a sequence spread over both servers: verified run exits 0" test $? -eq 0
check "spread: JSON, one sequence on both servers" json_check "$WORK/spread.json" 2 1 4200 spread

for i in 0 1; do
  METRICS_ADDR=${METRICS[$i]}
  check "server $i: every page freed afterwards" test "$(metric 'attnserve_kv_pages{state="used"}')" = 0
done

# refused ARGS... EXIT_CODE PATTERN: exits with that code and says PATTERN on stderr.
refused() {
  local pattern=${*: -1} code=${*: -2:1}
  "$BENCH" "${@:1:$#-2}" >/dev/null 2>"$WORK/refused.err"
  local rc=$?
  [[ $rc -eq $code ]] || { echo "exit $rc, want $code"; cat "$WORK/refused.err"; return 1; }
  grep -q -- "$pattern" "$WORK/refused.err" || { cat "$WORK/refused.err"; return 1; }
}
check "no --targets refused" refused 2 "--targets is empty"
check "--clients=0 refused" refused --targets="$TWO" --clients=0 2 "--clients=0 must be >= 1"
check "--kv_len=0 refused" refused --targets="$TWO" --kv_len=0 2 "--kv_len=0 must be >= 1"
check "--duration_s=0 refused" refused --targets="$TWO" --duration_s=0 2 "--duration_s=0 must be in (0, 1e7]"
check "--duration_s=1e300 refused" refused --targets="$TWO" --duration_s=1e300 2 "--duration_s=1e+300 must be in (0, 1e7]"
check "--layer past the servers' layers refused" refused --targets="$TWO" --layer=2 2 \
  "--layer=2 must be < the servers' num_layers (2)"
check "--metrics of another length refused" refused --targets="$TWO" --metrics="${METRICS[0]}" 2 \
  "--metrics has 1 addresses but the cluster has 2 servers"
check "more pages than the servers have refused up front" refused --targets="$TWO" --clients=4 \
  --batch=8 --kv_len=1024 1 \
  "= 2048 pages, but the servers have 512 free .*: lower --clients, --batch or --kv_len"
finish
