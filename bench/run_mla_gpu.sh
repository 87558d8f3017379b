#!/usr/bin/env bash
# Runs the MLA kernel family on this machine's GPU: its GPU tests against the
# float64 reference (kernels/plan + kernels/mla), compute-sanitizer's memcheck
# and racecheck over two of them each, the server's MLA tests (tests/integration/mla_test.cc)
# against a CUDA server at DeepSeek's widths (512 + 64), attnserve_mla_bench
# and the PyTorch baselines (bench/mla_torch.py), one after the other, and
# prints a summary last. Steps are capped at 240 + 120 + 240 + 240 + 90 + 90 s.
#
# Usage: bench/run_mla_gpu.sh INSTALL_DIR OUT_DIR
#   INSTALL_DIR: cmake --install build --prefix INSTALL_DIR --component mla_gpu
#     (bin/attnserve_gpu_mla_tests, bin/attnserve_mla_bench, lib/), and for
#     the server step bin/attnserve and bin/integration_test (skipped when
#     absent).
#   OUT_DIR receives device.txt, mla_tests.log, sanitizer.log, racecheck.log,
#     mla_server.log, mla_bench.log, mla_torch.log and summary.txt.
set -u
if [[ $# -ne 2 ]]; then
  echo "usage: $0 INSTALL_DIR OUT_DIR" >&2
  exit 2
fi
inst=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$inst/lib:${LD_LIBRARY_PATH:-}"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit \
  --format=csv,noheader | tee "$out/device.txt"

step() {  # step NAME LOG SECONDS COMMAND...
  local name=$1 log=$2 secs=$3
  shift 3
  echo "== $name"
  timeout "$secs" "$@" > "$out/$log" 2>&1
  local rc=$?
  echo "$name: exit $rc" | tee -a "$out/summary.txt"
  [[ $rc -eq 0 ]] || status=1
}
step "MLA kernel tests" mla_tests.log 240 "$inst/bin/attnserve_gpu_mla_tests"
if command -v compute-sanitizer >/dev/null 2>&1; then
  step "compute-sanitizer (memcheck)" sanitizer.log 120 compute-sanitizer --error-exitcode=1 \
    "$inst/bin/attnserve_gpu_mla_tests" \
    --gtest_filter='*H16Ps16DecodeBf16*:*H128Ps1PrefillFp16Variants*'
  # The kernel shares S's row maxima and P between warps through shared
  # memory: racecheck over one decode and one prefill configuration.
  step "compute-sanitizer (racecheck)" racecheck.log 240 compute-sanitizer --tool racecheck \
    --error-exitcode=1 "$inst/bin/attnserve_gpu_mla_tests" \
    --gtest_filter='*H16Ps16DecodeBf16*:*H16Ps64PrefillBf16Variants*'
fi
if [[ -x "$inst/bin/integration_test" && -x "$inst/bin/attnserve" ]]; then
  step "MLA through a CUDA server" mla_server.log 240 env ATTNSERVE_BIN="$inst/bin/attnserve" \
    ATTNSERVE_TEST_SERVER_FLAGS=--backend=cuda ATTNSERVE_TEST_MLA_WIDTHS=512,64 \
    "$inst/bin/integration_test" \
    --gtest_filter='MlaServerTest.*:PageSizes/MlaPrefillTest.*'
fi
step "attnserve_mla_bench" mla_bench.log 90 "$inst/bin/attnserve_mla_bench"
step "PyTorch baselines" mla_torch.log 90 python3 "$here/mla_torch.py"
{
  grep -E "^\[  (PASSED|FAILED) |tests? ran" "$out/mla_tests.log"
  [[ -f "$out/mla_server.log" ]] && grep -E "^\[  (PASSED|FAILED) |tests? ran" "$out/mla_server.log"
  grep -E "^RESULT" "$out/mla_bench.log"
  grep -E "^TORCH" "$out/mla_torch.log"
} | tee -a "$out/summary.txt"
exit $status
