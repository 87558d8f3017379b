#!/usr/bin/env bash
# Live metrics: drives traffic through a real server, then checks the scrape
# with promtool, checks that every docs/design.md section 7 family is present and
# moves as the traffic implies, that every metric name the dashboard and the
# alert rules use is exported, and that a real Prometheus server scrapes it.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/ops/lib.sh"
trap 'stop_server; [[ -n "${PROM_PID:-}" ]] && kill $PROM_PID 2>/dev/null; rm -rf "${PROM_DIR:-}"' EXIT

start_server || { echo "0 passed, 1 failed"; exit 1; }
free0=$(metric 'attnserve_kv_pages{state="free"}')
check "kv_pages free starts at num_pages" test "$free0" = 256

# Traffic: 3 verified prefills (alloc, write, prefill, free each), a merge and a bad call.
for seed in 1 2 3; do
  "$ATTNCTL" --target="$GRPC_ADDR" --seed=$seed prefill --batch=3 --q_len=16 --kv_len=64 >/dev/null
done
"$ATTNCTL" --target="$GRPC_ADDR" merge --n=4 >/dev/null
"$ATTNCTL" --target="$GRPC_ADDR" regions >/dev/null  # the region and channel gauges get their tenant
"$ATTNCTL" --target="$GRPC_ADDR" holdings >/dev/null  # and the lease gauge
"$ATTNCTL" --target="$GRPC_ADDR" free 100000 >/dev/null 2>&1

body=$(scrape)
check "promtool accepts the live scrape" promtool check metrics <<<"$body"
for family in attnserve_requests_total attnserve_request_duration_seconds \
  attnserve_queue_wait_seconds attnserve_batch_requests attnserve_batch_tokens \
  attnserve_kernel_launches_total attnserve_kernel_duration_seconds attnserve_kv_pages \
  attnserve_transfer_bytes_total attnserve_inflight_requests attnserve_queue_depth \
  attnserve_tenant_kv_pages attnserve_device_memory_bytes attnserve_build_info \
  process_start_time_seconds; do
  check "family $family present" grep -q "^# TYPE $family " <<<"$body"
done
ok_prefills=$(( $(metric 'attnserve_requests_total{code="OK",method="Prefill",shape="prefill"}') +
  $(metric 'attnserve_requests_total{code="OK",method="Prefill",shape="decode"}') ))
check "requests_total counts 3 OK Prefill (decode and prefill shapes)" test "$ok_prefills" = 3
check "requests_total counts the bad FreePages as INVALID_ARGUMENT" \
  test "$(metric 'attnserve_requests_total{code="INVALID_ARGUMENT",method="FreePages",shape="none"}')" = 1
check "queue depth back to 0" test "$(metric 'attnserve_queue_depth')" = 0
check "tenant default holds no pages after the frees" \
  test "$(metric 'attnserve_tenant_kv_pages{tenant="default"}')" = 0
check "build_info names the version and the backend" \
  grep -q '^attnserve_build_info{.*backend="cpu".*version="' <<<"$body"
check "process_start_time_seconds is a recent Unix time" \
  awk -v v="$(metric 'process_start_time_seconds')" -v now="$(date +%s)" 'BEGIN { exit !(v > now - 600 && v <= now + 1) }'
check "device memory used is the KV pool" \
  awk -v v="$(metric 'attnserve_device_memory_bytes{state="used"}')" 'BEGIN { exit !(v > 0) }'
check "no NaN in the scrape" bash -c '! grep -qi "nan$" <<<"$1"' _ "$body"
check "kv_pages free back to the start after frees" test "$(metric 'attnserve_kv_pages{state="free"}')" = 256
check "kv_pages used back to 0" test "$(metric 'attnserve_kv_pages{state="used"}')" = 0
check "3 attention launches" test "$(metric 'attnserve_kernel_launches_total{kernel="attention"}')" = 3
check "attention_decode series present, 0 on the CPU backend" test "$(metric 'attnserve_kernel_launches_total{kernel="attention_decode"}')" = 0
check "kv_rows launches for the writes" test "$(metric 'attnserve_kernel_launches_total{kernel="kv_rows"}')" = 3
check "no fused appends (the writes are WriteKV)" test "$(metric 'attnserve_kernel_launches_total{kernel="append"}')" = 0
check "freed pages zeroed" awk -v v="$(metric 'attnserve_kernel_launches_total{kernel="zero_pages"}')" 'BEGIN { exit !(v >= 1) }'
check "batch_requests observed once per launch" test "$(metric 'attnserve_batch_requests_count')" = 3
check "transfer bytes in counted" awk -v v="$(metric 'attnserve_transfer_bytes_total{direction="in",path="inline"}')" 'BEGIN { exit !(v > 0) }'
check "transfer bytes out counted" awk -v v="$(metric 'attnserve_transfer_bytes_total{direction="out",path="inline"}')" 'BEGIN { exit !(v > 0) }'
check "no request left in flight" test "$(metric 'attnserve_inflight_requests')" = 0

# Every metric name used by the dashboard and the alert rules is exported.
names=$(cat "$ROOT"/deploy/grafana/*.json "$ROOT"/deploy/prometheus/*.yaml 2>/dev/null |
  grep -o 'attnserve_[a-z_]*' | sed -E 's/_(bucket|sum|count)$//' | sort -u)
check "dashboard and rules name at least one metric" test -n "$names"
for n in $names; do
  check "dashboard/rules metric $n is exported" grep -q "^# TYPE $n " <<<"$body"
done

# A real Prometheus server scrapes the live server.
PROM_DIR=$(mktemp -d)
cat >"$PROM_DIR/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
scrape_configs:
  - job_name: attnserve
    static_configs:
      - targets: ['$METRICS_ADDR']
YAML
prom_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
prometheus --config.file="$PROM_DIR/prometheus.yml" --storage.tsdb.path="$PROM_DIR/data" \
  --web.listen-address="127.0.0.1:$prom_port" >"$PROM_DIR/log" 2>&1 &
PROM_PID=$!
got=""
for _ in $(seq 1 120); do
  got=$(curl -sf "http://127.0.0.1:$prom_port/api/v1/query?query=sum(attnserve_requests_total%7Bmethod%3D%22Prefill%22%7D)" |
    python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")' 2>/dev/null)
  [[ -n "$got" ]] && break
  sleep 0.25
done
check "Prometheus scraped attnserve_requests_total (Prefill = 3)" test "$got" = 3
[[ "$got" == 3 ]] || tail -20 "$PROM_DIR/log"
finish
