# Shared helpers for the shell tests under tests/ops (sourced).
# Usage: ATTNSERVE=... ATTNCTL=... start_server [flags...]; sets SERVER_PID,
# GRPC_ADDR, METRICS_ADDR; stop_server kills it.

pass=0
fail=0
check() {  # check "description" command...
  local what=$1; shift
  if "$@"; then pass=$((pass + 1)); echo "PASS: $what"; else fail=$((fail + 1)); echo "FAIL: $what"; fi
}
finish() {
  echo "$pass passed, $fail failed"
  [[ $fail -eq 0 ]]
}

start_server() {
  SERVER_LOG=$(mktemp)
  "$ATTNSERVE" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 --backend=cpu \
    --num_layers=2 --num_pages=256 --page_size=16 --num_qo_heads=8 --num_kv_heads=2 \
    --head_dim=64 "$@" >"$SERVER_LOG" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 200); do
    if grep -q "listening grpc=" "$SERVER_LOG"; then break; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then cat "$SERVER_LOG"; return 1; fi
    sleep 0.05
  done
  GRPC_ADDR=$(grep -o "grpc=[^ ]*" "$SERVER_LOG" | head -1 | cut -d= -f2)
  METRICS_ADDR=$(grep -o "metrics=[^ ]*" "$SERVER_LOG" | head -1 | cut -d= -f2)
  # Ready when health says SERVING (attnctl health polls, no fixed sleep).
  for _ in $(seq 1 200); do
    "$ATTNCTL" --target="$GRPC_ADDR" health >/dev/null 2>&1 && return 0
    sleep 0.05
  done
  echo "server never became SERVING"; cat "$SERVER_LOG"; return 1
}

stop_server() {
  if [[ -n "${SERVER_PID:-}" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
  fi
}

scrape() { curl -sf "http://$METRICS_ADDR/metrics"; }

# Value of one exposition line (exact series text before the value), or 0.
metric() {
  local series=$1
  scrape | awk -v s="$series" 'index($0, s" ") == 1 { print $2; found=1 } END { if (!found) print 0 }'
}
