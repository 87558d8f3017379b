#!/usr/bin/env bash
# Checks and times the Hopper prefill family (kernels/sm90/) against the sm80
# family on this machine's GPU, one step after another (never concurrently):
#   1. the kernel tests, both families (Families/PagedPrefillCuda.*/sm80 and
#      .../sm90 against the float64 reference, the CUDA backend end to end
#      with --prefill_kernel auto and sm90; merge and KV-row tests too).
#      TilesWithNoKvBlockBesideBusyTiles/sm80 (73 s of CPU reference, the sm80
#      kernel unchanged) is left to bench/run_gpu.sh to stay under 5 minutes;
#   2. attnserve_kernel_bench --quick --kernel=sm80, then --kernel=sm90, on
#      the anchor workloads (long, batch, prefix, decode; page_size 1 and 16);
#   3. cuobjdump -sass of the bench binary: HGMMA / HMMA counts per sm90
#      kernel (a wgmma kernel whose SASS shows no HGMMA is on a slower path);
#   4. if ncu exists, one profiled launch of the long workload's sm90 kernel.
# Under 5 minutes on an H200 (steps capped at 30 + 160 + 2 x 30 + 15 + 30 s).
#
# Usage: bench/run_sm90_gpu.sh INSTALL_DIR OUT_DIR
#   INSTALL_DIR: cmake --install build --prefix INSTALL_DIR --component sm90_gpu
#     (bin/attnserve_gpu_kernel_tests, bin/attnserve_kernel_bench)
#   OUT_DIR receives device.txt, tests_ladder.log, tests.log, bench_sm80.log, bench_sm90.log,
#     sass_counts.txt, ncu.log and summary.txt.
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

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader \
  | tee "$out/device.txt"
git -C "$here" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /' | tee -a "$out/device.txt"

# The ladder first and alone (one tile, one block, then ring wraps), so its
# verdict survives a later test that hangs or crashes.
echo "== kernel tests: the single-tile ladder (both families)"
timeout 30 "$inst/bin/attnserve_gpu_kernel_tests" --gtest_filter='*SingleTileLadder*' > "$out/tests_ladder.log" 2>&1
rc=$?
echo "ladder exit code: $rc" | tee -a "$out/tests_ladder.log"
[[ $rc -ne 0 ]] && status=1
grep -E "^\[       OK \]|^\[  FAILED  \]|^\[  SKIPPED \]|Failure|skipped:|kv [0-9]+:" "$out/tests_ladder.log" | head -20

echo "== kernel tests (both families)"
timeout 160 "$inst/bin/attnserve_gpu_kernel_tests" \
  --gtest_filter='*PagedPrefillCuda.*:*CudaBackendFamily.*:MergeStatesCuda.*:AppendKvCuda.*-*TilesWithNoKvBlockBesideBusyTiles/sm80:*SingleTileLadder*' \
  > "$out/tests.log" 2>&1
rc=$?
echo "tests exit code: $rc" | tee -a "$out/tests.log"
[[ $rc -ne 0 ]] && status=1
if grep -q "^\[  SKIPPED \]" "$out/tests.log" "$out/tests_ladder.log"; then
  echo "some tests were SKIPPED (no GPU, or not an sm_90 device for .../sm90)" | tee -a "$out/tests.log"
  status=1
fi
grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|^\[       OK \]|^\[  FAILED  \]|Failure|skipped:|error" "$out/tests.log" | head -60

for k in sm80 sm90; do
  echo "== kernel bench --kernel=$k"
  timeout 30 "$inst/bin/attnserve_kernel_bench" --quick --kernel=$k --workload=long,batch,prefix,decode \
    > "$out/bench_$k.log" 2>&1
  rc=$?
  echo "bench exit code: $rc" | tee -a "$out/bench_$k.log"
  [[ $rc -ne 0 ]] && status=1
done

echo "== SASS of the sm90 kernels (HGMMA = wgmma)"
if command -v cuobjdump > /dev/null; then
  timeout 15 cuobjdump -sass "$inst/bin/attnserve_kernel_bench" 2> "$out/cuobjdump.err" | awk '
    /Function :/ { fn = $NF }
    fn ~ /Sm90/ && /HGMMA/ { hg[fn]++ }
    fn ~ /Sm90/ && /HMMA/ { hm[fn]++ }
    fn ~ /Sm90/ && /LDL|STL/ { ls[fn]++ }
    fn ~ /Sm90/ { seen[fn] = 1 }
    END { for (f in seen) printf "%s HGMMA=%d HMMA=%d LDL/STL=%d\n", f, hg[f], hm[f], ls[f] }' \
    | tee "$out/sass_counts.txt"
  [[ -s "$out/sass_counts.txt" ]] || echo "no sm90 kernel found in the SASS" | tee "$out/sass_counts.txt"
else
  echo "cuobjdump not found" | tee "$out/sass_counts.txt"
fi

echo "== ncu (long workload, sm90)"
if command -v ncu > /dev/null; then
  timeout 30 ncu --clock-control none \
    --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    -k regex:Sm90 --launch-count 1 "$inst/bin/attnserve_kernel_bench" --quick --kernel=sm90 --workload=long \
    > "$out/ncu.log" 2>&1
  echo "ncu exit code: $?" | tee -a "$out/ncu.log"
  grep -E "PagedPrefill|hmma|throughput" "$out/ncu.log" | head -10
else
  echo "ncu not found" | tee "$out/ncu.log"
fi

python3 - "$out" <<'PY' | tee "$out/summary.txt"
import os, re, sys
d = sys.argv[1]
def kv(line):
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}
res = {}
for k in ("sm80", "sm90"):
    p = os.path.join(d, f"bench_{k}.log")
    if not os.path.exists(p): continue
    for line in open(p, errors="replace"):
        if line.startswith("RESULT kernel=prefill"):
            r = kv(line)
            if r.get("section_mb", "16") != "16": continue
            key = (r["workload"], r["page_size"])
            best = res.setdefault(key, {}).get(k)
            if best is None or float(r["ms"]) < float(best["ms"]): res[key][k] = r
targets = {"long": 540, "batch": 480, "prefix": 420}
print("| workload | ps | sm80 TFLOP/s | sm90 TFLOP/s | target | sm80 ms | sm90 ms |")
print("|---|---|---|---|---|---|---|")
for (w, ps), v in res.items():
    a, b = v.get("sm80"), v.get("sm90")
    f = lambda r, key: "-" if r is None else r[key]
    print(f'| {w} | {ps} | {f(a, "tflops")} | {f(b, "tflops")} | {targets.get(w, "-")} | {f(a, "ms")} | {f(b, "ms")} |')
PY
exit $status
