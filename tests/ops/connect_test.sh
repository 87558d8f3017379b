#!/usr/bin/env bash
# What a client says when it cannot connect, through attnctl (the C++
# client): a refused port, a host that does not resolve and an HTTP/1 port
# (the metrics one) each fail at once with their cause named, although
# --connect_timeout_s would allow minutes (a generous watchdog, not a
# timing bound, catches a client that waits anyway); gRPC's own log lines
# stay off stderr; --connect_timeout_s is a flag. TLS mismatches are in
# security_test.sh.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/ops/lib.sh"
WORK=$(mktemp -d)
trap 'stop_server; rm -rf "$WORK"' EXIT

# ctl_fails NAME PATTERN ARGS...: attnctl ARGS exits 1 within the watchdog,
# its stderr matches PATTERN and holds no gRPC log line.
ctl_fails() {
  local name=$1 pattern=$2
  shift 2
  timeout 120 "$ATTNCTL" --connect_timeout_s=600 "$@" >"$WORK/out" 2>"$WORK/err"
  local rc=$?
  check "$name: exits 1 (not the watchdog's 124: no wait for the deadline)" test $rc -eq 1
  check "$name: says '$pattern'" grep -q -- "$pattern" "$WORK/err" "$WORK/out"
  check "$name: no gRPC log line on stderr" bash -c '! grep -Eq "^[EIWD][0-9]{4} |chttp2|Handshake failed" "$1"' _ "$WORK/err"
  [[ $rc -eq 1 ]] || cat "$WORK/out" "$WORK/err"
}

free_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ctl_fails "refused" "connection refused: nothing listens on 127.0.0.1:$free_port" \
  --target="127.0.0.1:$free_port" info
ctl_fails "refused, health" "UNAVAILABLE: connection refused: nothing listens on" \
  --target="127.0.0.1:$free_port" health
ctl_fails "unresolvable host" "cannot resolve the host of no-such-host.invalid:50051" \
  --target=no-such-host.invalid:50051 info

start_server || { echo "0 passed, 1 failed"; exit 1; }
ctl_fails "the metrics port" "$METRICS_ADDR answers HTTP/1, not gRPC: is it attnserve's metrics port" \
  --target="$METRICS_ADDR" info
check "the gRPC port answers" "$ATTNCTL" --connect_timeout_s=30 --target="$GRPC_ADDR" info
# One state, a third of whose rows see nothing: those merge to (0, -inf),
# which attnctl's reference once computed as NaN (exit 3 on a right answer).
check "attnctl merge --states=1 verifies" "$ATTNCTL" --target="$GRPC_ADDR" merge --states=1
check "--help lists --connect_timeout_s" bash -c '"$1" --help | grep -q -- "--connect_timeout_s=10 "' _ "$ATTNCTL"
# info prints every field, a zero too: free_pages 0 when the cache is full.
"$ATTNCTL" --target="$GRPC_ADDR" alloc 256 >/dev/null
check "info says free_pages: 0 on a full cache" bash -c '"$1" --target="$2" info | grep -qx "free_pages: 0"' _ \
  "$ATTNCTL" "$GRPC_ADDR"
check "... and every field of ServerInfo" bash -c '[ "$("$1" --target="$2" info | wc -l)" -ge 25 ]' _ \
  "$ATTNCTL" "$GRPC_ADDR"
"$ATTNCTL" --target="$GRPC_ADDR" release-all >/dev/null
# Connection flags and arguments refused before connecting (exit 2), each
# naming the flag or argument and its bound.
ctl_refuses() {  # ctl_refuses NAME PATTERN ARGS...
  local name=$1 pattern=$2
  shift 2
  "$ATTNCTL" "$@" >"$WORK/out" 2>"$WORK/err"
  local rc=$?
  check "$name: exits 2" test $rc -eq 2
  check "$name: says '$pattern'" grep -qF -- "$pattern" "$WORK/err"
}
ctl_refuses "an empty --target" "--target is empty" --target= info
ctl_refuses "a port past 65535" "port 99999 out of range [1, 65535]" --target=127.0.0.1:99999 info
ctl_refuses "an unreadable --tls_ca" "--tls_ca=$WORK/none.pem: cannot open" --tls --tls_ca="$WORK/none.pem" \
  --target="$GRPC_ADDR" info
ctl_refuses "an unreadable --tls_ca (TLS implied)" "--tls_ca=$WORK/none.pem: cannot open" --tls_ca="$WORK/none.pem" \
  --target="$GRPC_ADDR" info
ctl_refuses "--tls_key without --tls_cert" "--tls_key=/etc/hostname needs tls_cert" --tls_key=/etc/hostname \
  --target="$GRPC_ADDR" info
ctl_refuses "alloc past int32" "COUNT 99999999999 (argument 1) out of range [0, 2147483647]" \
  --target="$GRPC_ADDR" alloc 99999999999
ctl_refuses "alloc of a word" "COUNT abc (argument 1) is not an integer" --target="$GRPC_ADDR" alloc abc
finish
