#!/usr/bin/env bash
# Live metrics: checks a fresh server's scrape against the naming rules
# (tests/ops/metrics_naming.py) and promtool, HEAD /metrics, then drives
# traffic through it, checks the scrape again, checks that every docs/design.md
# section 7 family is present and moves as the traffic implies, that every metric name the dashboard and the
# alert rules use is exported, and that a real Prometheus server scrapes it.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/ops/lib.sh"
WORK=$(mktemp -d)
trap 'stop_server; [[ -n "${PROM_PID:-}" ]] && kill $PROM_PID 2>/dev/null; rm -rf "${PROM_DIR:-}" "$WORK"' EXIT

start_server || { echo "0 passed, 1 failed"; exit 1; }
free0=$(metric 'attnserve_kv_pages{state="free"}')
check "kv_pages free starts at num_pages" test "$free0" = 256
# Before any call: the naming rules, and every family there already.
scrape >"$WORK/fresh.txt"
check "naming rules hold on a fresh server (metrics_naming.py --fresh)" \
  python3 "$ROOT/tests/ops/metrics_naming.py" "$WORK/fresh.txt" --fresh
check "promtool accepts the fresh scrape" promtool check metrics <"$WORK/fresh.txt"
# 2 layers x 2 (K and V) x 256 pages x 16 rows x 2 heads x 64 x 2 bytes.
check "kv_cache_bytes is the KV cache's size" test "$(metric 'attnserve_kv_cache_bytes')" = 4194304
check "no device memory families on the CPU backend" \
  bash -c '! grep -q "^attnserve_device_memory" "$1"' _ "$WORK/fresh.txt"
check "HEAD /metrics answers 200 with no body" bash -c '
  out=$(curl -sS -o "$2" -w "%{http_code} %{content_type}" -I "http://$1/metrics") &&
  [[ "$out" == "200 text/plain; version=0.0.4; charset=utf-8" ]] && grep -q "^Content-Length: [1-9]" "$2"' \
  _ "$METRICS_ADDR" "$WORK/head.txt"
check "process_resident_memory_bytes is this server's RSS (> 1 MiB)" \
  awk -v v="$(metric 'process_resident_memory_bytes')" 'BEGIN { exit !(v > 1048576) }'
check "process_open_fds counts the server's descriptors" \
  awk -v v="$(metric 'process_open_fds')" 'BEGIN { exit !(v >= 3) }'

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
printf '%s\n' "$body" >"$WORK/live.txt"
check "naming rules hold after traffic (metrics_naming.py)" \
  python3 "$ROOT/tests/ops/metrics_naming.py" "$WORK/live.txt"
for family in attnserve_requests_total attnserve_request_duration_seconds \
  attnserve_queue_wait_seconds attnserve_batch_requests attnserve_batch_query_rows \
  attnserve_kernel_launches_total attnserve_kernel_duration_seconds attnserve_kv_pages \
  attnserve_transfer_bytes_total attnserve_inflight_requests attnserve_queue_depth \
  attnserve_tenant_kv_pages attnserve_kv_cache_bytes attnserve_build_info \
  attnserve_tenant_regions attnserve_tenant_region_bytes attnserve_open_channels \
  process_start_time_seconds process_cpu_seconds_total process_resident_memory_bytes \
  process_virtual_memory_bytes process_open_fds process_max_fds; do
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
check "no NaN in the scrape" bash -c '! grep -qi "nan$" <<<"$1"' _ "$body"
check "kv_pages free back to the start after frees" test "$(metric 'attnserve_kv_pages{state="free"}')" = 256
check "kv_pages used back to 0" test "$(metric 'attnserve_kv_pages{state="used"}')" = 0
check "3 attention launches (all on the CPU backend's one kernel)" test "$(metric 'attnserve_kernel_launches_total{kernel="attention_prefill"}')" = 3
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
  case $n in
    attnserve_device_memory_*_bytes) continue ;;  # CUDA backend only (docs/design.md section 7)
  esac
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
