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

# The geometry attnecho reports must be one attnserve serves (attnbench and
# the clients compute with it); a flag outside it exits 2 naming it, as
# attnserve's own.
for bad in "--page_size=0|--page_size=0 out of range [1, 128]" "--num_layers=0|--num_layers=0 out of range" \
           "--num_kv_heads=3|must be in [1, 256] and a multiple of --num_kv_heads=3" \
           "--head_dim=100|--head_dim=100 must be 64, 128 or 256" "--kv_dtype=fp8_e4m3|must be bf16 or fp16" \
           "--num_pages=-1|--num_pages=-1 out of range" "--max_message_bytes=0|--max_message_bytes=0 out of range" \
           "--listen=nonsense|--listen=nonsense must be HOST:PORT"; do
  timeout 20 "$ATTNECHO" --listen=127.0.0.1:0 "${bad%%|*}" >"$WORK/bad.log" 2>&1
  rc=$?
  check "attnecho ${bad%%|*}: exits 2" test $rc -eq 2
  check "... naming it" grep -qF -- "${bad#*|}" "$WORK/bad.log"
done
# tcp_echo (the floor under attnecho): cases past 1 GiB, negative counts and
# both roles at once exit 2 before anything is allocated.
TCP_ECHO=$(dirname "$ATTNECHO")/tcp_echo
for bad in "--cases=99999999999999:1|is not IN:OUT, each a byte count in [0, 1073741824]" \
           "--cases=|--cases is empty" "--iterations=-1|--iterations=-1 must be >= 0" \
           "--listen=127.0.0.1:0 --connect=127.0.0.1:1|exclude each other"; do
  # shellcheck disable=SC2086
  timeout 20 "$TCP_ECHO" ${bad%%|*} >"$WORK/bad.log" 2>&1
  rc=$?
  check "tcp_echo ${bad%%|*}: exits 2" test $rc -eq 2
  check "... naming it" grep -qF -- "${bad#*|}" "$WORK/bad.log"
done
check "tcp_echo measures a small case" timeout 60 "$TCP_ECHO" --cases=1024:1024 --iterations=5

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
