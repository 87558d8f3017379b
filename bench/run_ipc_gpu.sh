#!/usr/bin/env bash
# On the GPU host (two H200s for the issue #16 targets): CUDA IPC regions end
# to end, about 3 minutes in all.
#   1. attnserve_gpu_region_tests: this process exports device memory on GPU 0,
#      a CUDA server in another process (GPU 1 when two are visible) reads and
#      writes it; WriteKV, ReadKV, Prefill (decode and a chunk) and MergeStates
#      against the float64 reference; bad references; unregister while in use;
#      a client killed (SIGKILL) while holding CUDA regions.
#   2. bench/ipc.py: the torch client on GPU 0, the server on GPU 1, every
#      tensor in CUDA regions: decode64 p50 and the 16k-row (128 MiB) prefill,
#      checked against float64 rows first.
#   bench/run_ipc_gpu.sh INSTALL_DIR OUT_DIR
# INSTALL_DIR: `cmake --install build --prefix DIR` and
# `cmake --install build --prefix DIR --component ipc_gpu` (the test binaries).
# Needs python3 with numpy, grpcio, protobuf and torch (CUDA). Logs in OUT_DIR,
# the summary last.
set -uo pipefail
if (($# != 2)); then
  echo "usage: $0 INSTALL_DIR OUT_DIR" >&2
  exit 2
fi
inst=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m
  "$inst/bin/attnserve" --version
} 2>&1 | tee "$out/device.txt"

echo "== 1. CUDA region GPU tests (two processes)"
ATTNSERVE_BIN="$inst/bin/attnserve" CUDA_REGION_HOLDER_BIN="$inst/bin/cuda_region_holder" \
  LD_LIBRARY_PATH="$inst/lib" timeout 150 "$inst/bin/attnserve_gpu_region_tests" \
  >"$out/region_tests.log" 2>&1
tests_rc=$?
grep -E "^\[ *(OK|FAILED|PASSED|SKIPPED) *\]|client on device|Failure" "$out/region_tests.log" | head -40

echo "== 2. CUDA IPC benchmark (torch client on GPU 0)"
timeout 150 python3 "$here/ipc.py" "$inst" "$out" >"$out/ipc.log" 2>&1
bench_rc=$?
tail -20 "$out/ipc.log"

echo "== summary"
{
  echo "region tests: rc=$tests_rc ($( grep -cE '^\[       OK \]' "$out/region_tests.log") passed," \
       "$(grep -cE '^\[  FAILED  \]' "$out/region_tests.log") failed lines; 124 = timeout)"
  echo "ipc benchmark: rc=$bench_rc (124 = timeout)"
  [[ -f "$out/ipc.md" ]] && cat "$out/ipc.md"
} | tee "$out/summary.txt"
((tests_rc == 0 && bench_rc == 0))
