#!/usr/bin/env bash
# On a GPU machine: checks the relocatable install and runs the server-level
# GPU tests (the CUDA server against a CPU server and the float64 reference).
#   bench/run_server_gpu.sh INSTALL_DIR OUT_DIR [ATTNSERVE_BUILD_PATH]
# INSTALL_DIR is `cmake --install build --prefix DIR` plus the test binary
# attnserve_gpu_server_tests copied into DIR/bin.
set -uo pipefail
inst=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"

echo "== relocatable install: no LD_LIBRARY_PATH, only glibc and the driver"
( unset LD_LIBRARY_PATH; ldd "$inst/bin/attnserve" | grep -E "not found" && echo "MISSING LIBS" )
log=$(mktemp)
( unset LD_LIBRARY_PATH; "$inst/bin/attnserve" --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0 \
    --num_pages=4096 >"$log" 2>&1 & echo $! >"$log.pid" )
for _ in $(seq 1 200); do grep -q "listening grpc=" "$log" && break; sleep 0.05; done
head -2 "$log" | tee "$out/server_start.txt"
addr=$(grep -o "grpc=[^ ]*" "$log" | cut -d= -f2)
( unset LD_LIBRARY_PATH
  "$inst/bin/attnctl" --target="$addr" health
  "$inst/bin/attnctl" --target="$addr" prefill --batch=8 --q_len=256 --kv_len=2048
  "$inst/bin/attnctl" --target="$addr" --causal=false --lse_base_e prefill --batch=16 --q_len=1 --kv_len=4096
  "$inst/bin/attnctl" --target="$addr" merge --states=4 --n=64 ) 2>&1 | tee "$out/attnctl.txt"
kill -TERM "$(cat "$log.pid")"; sleep 1

echo "== server-level GPU tests"
# The test binary starts attnserve by the path it was built with.
bin_path=${3:-/work/main/build/bin/attnserve}
mkdir -p "$(dirname "$bin_path")"
ln -sf "$inst/bin/attnserve" "$bin_path"
LD_LIBRARY_PATH="$inst/lib" "$inst/bin/attnserve_gpu_server_tests" 2>&1 | tee "$out/server_gpu_tests.txt" |
  grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) *\]|requests=|Failure|error" | head -60
