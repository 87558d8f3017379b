#!/usr/bin/env bash
# attnecho (the transport floor) answers attnbench exactly as attnserve
# would in shape and size: a closed-loop decode and prefill run against it
# exits 0 with every request answered, and reports no TFLOP/s.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/ops/lib.sh"
WORK=$(mktemp -d)
ECHO_PID=""
trap '[[ -n "$ECHO_PID" ]] && kill "$ECHO_PID" 2>/dev/null; rm -rf "$WORK"' EXIT

"$ATTNECHO" --listen=127.0.0.1:0 --num_qo_heads=8 --num_kv_heads=2 --head_dim=64 >"$WORK/echo.log" 2>&1 &
ECHO_PID=$!
for _ in $(seq 1 200); do grep -q "listening grpc=" "$WORK/echo.log" && break; sleep 0.05; done
addr=$(grep -o "grpc=[^ ]*" "$WORK/echo.log" | cut -d= -f2)
check "attnecho reports its port" test -n "$addr"
for w in decode prefill; do
  "$ATTNBENCH" --target="$addr" --workload=$w --concurrency=4 --requests=40 --batch=4 --q_len=32 \
    --kv_len=256 --json="$WORK/$w.json" >"$WORK/$w.out" 2>"$WORK/$w.err"
  check "$w against attnecho exits 0" test $? -eq 0
  check "$w: 40 requests answered" python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['requests'] == r['ok'] == 40, r" "$WORK/$w.json"
  # attnecho computes nothing: no FLOP rate, in the JSON or the table.
  check "$w: no TFLOP/s for attnecho" python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['tflops'] is None, r['tflops']" "$WORK/$w.json"
  check "$w: the table says attnecho computes nothing" bash -c '! grep -q TFLOP "$1" && grep -q "no compute" "$1"' _ "$WORK/$w.out"
done
finish
