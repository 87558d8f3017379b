#!/usr/bin/env bash
# Checks and times the Hopper prefill family's schedules (kernels/sm90/,
# traits.cuh Schedule) on this machine's GPU, one step after another:
#   1. the kernel tests of the three sm90 kernels against the float64
#      reference, every geometry (Families/PagedPrefillCuda.*/sm90_overlap,
#      .../sm90, .../sm90_overlap_nopp) in three processes: the single-tile
#      ladder (10 s), the small tests (30 s), the two long ones (110 s); in
#      each, the references computed for the first kernel serve the others;
#   2. attnserve_kernel_bench --quick --workload=long,batch,prefix,sweep for
#      sm80, sm90, sm90_overlap and sm90_overlap_nopp (22 s each);
#   3. cuobjdump -sass of the bench binary: HGMMA / HMMA / local-memory
#      instruction counts per sm90 kernel (15 s);
#   4. ncu, one launch each of the long workload's sm90_overlap kernel (50 s)
#      and sm90 kernel (30 s): tensor-pipe activity, tensor instructions,
#      achieved occupancy, MUFU (XU) pipe, throughputs;
#   5. summary.txt: test verdicts, the TFLOP/s table against the targets,
#      the SASS counts and the ncu metrics.
# Under 6 minutes on an H200 (steps capped at 10 + 30 + 110 + 4 x 22 + 15 +
# 15 + 50 + 30 s).
#
# Usage: bench/run_sm90_overlap_gpu.sh INSTALL_DIR OUT_DIR
#   INSTALL_DIR: cmake --install build --prefix INSTALL_DIR --component sm90_gpu
#     (bin/attnserve_gpu_kernel_tests, bin/attnserve_kernel_bench, lib/)
#   OUT_DIR receives device.txt, tests_{ladder,small,long}.log, bench_<kernel>.log,
#     sass_counts.txt, ncu_sm90_overlap.log, ncu_sm90.log and summary.txt.
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
tests="$inst/bin/attnserve_gpu_kernel_tests"
bench="$inst/bin/attnserve_kernel_bench"
kernels="sm80 sm90 sm90_overlap sm90_overlap_nopp"
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader \
  | tee "$out/device.txt"
git -C "$here" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /' | tee -a "$out/device.txt"
echo "host cores: $(nproc)" | tee -a "$out/device.txt"

verdicts() {
  grep -E "^\[       OK \]|^\[  FAILED  \]|^\[  SKIPPED \]|Failure|skipped:|error|exit code" "$1" | head -40
}

# Three processes, each under its own limit, so that a hang or a slow step
# leaves the others' verdicts: the ladder (one tile, one block, then ring
# wraps), the small geometries (causal shifts, dense tiles, forced splits),
# then the two long ones (300 random ragged batches; tiles with no KV block
# beside busy ones), whose float64 references dominate their time.
run_tests() {  # NAME LIMIT FILTER
  echo "== kernel tests: $1 (sm90 kernels)"
  timeout "$2" "$tests" --gtest_filter="$3" > "$out/tests_$1.log" 2>&1
  local rc=$?
  echo "tests exit code: $rc$([[ $rc -eq 124 ]] && echo ' (timed out: the tests after the last OK line did not run)')" \
    | tee -a "$out/tests_$1.log"
  [[ $rc -ne 0 ]] && status=1
  if grep -q "^\[  SKIPPED \]" "$out/tests_$1.log"; then
    echo "some tests were SKIPPED (no GPU, or not an sm_90 device)" | tee -a "$out/tests_$1.log"
    status=1
  fi
  verdicts "$out/tests_$1.log"
}
f='Families/PagedPrefillCuda'
run_tests ladder 10 "$f.SingleTileLadder/sm90*"
run_tests small 30 "$f.CausalShift/sm90*:$f.DenseLargeTiles/sm90*:$f.LongKvForcesSplit/sm90*"
run_tests long 110 "$f.RandomRaggedBatches/sm90*:$f.TilesWithNoKvBlockBesideBusyTiles/sm90*"

for k in $kernels; do
  echo "== kernel bench --kernel=$k"
  timeout 22 "$bench" --quick --kernel=$k --workload=long,batch,prefix,sweep > "$out/bench_$k.log" 2>&1
  rc=$?
  echo "bench exit code: $rc" | tee -a "$out/bench_$k.log"
  [[ $rc -ne 0 ]] && status=1
  grep "^RESULT" "$out/bench_$k.log" | sed -E 's/.*workload=([^ ]+).*page_size=([0-9]+).*ms=([^ ]+) tflops=([^ ]+).*/  \1 ps \2: \3 ms, \4 TFLOP\/s/'
done

echo "== SASS of the sm90 kernels (HGMMA = wgmma; LDL/STL = local memory)"
if command -v cuobjdump > /dev/null; then
  timeout 15 cuobjdump -sass "$bench" 2> "$out/cuobjdump.err" | awk '
    /Function :/ { fn = $NF }
    fn ~ /Sm90/ && /HGMMA/ { hg[fn]++ }
    fn ~ /Sm90/ && /[^G]MMA/ && !/HGMMA/ { hm[fn]++ }
    fn ~ /Sm90/ && /LDL|STL/ { ls[fn]++ }
    fn ~ /Sm90/ && /MUFU.EX2/ { ex[fn]++ }
    fn ~ /Sm90/ { seen[fn] = 1 }
    END { for (f in seen) printf "%s HGMMA=%d HMMA=%d LDL/STL=%d MUFU.EX2=%d\n", f, hg[f], hm[f], ls[f], ex[f] }' \
    | sort | tee "$out/sass_counts.txt"
  [[ -s "$out/sass_counts.txt" ]] || echo "no sm90 kernel found in the SASS" | tee "$out/sass_counts.txt"
else
  echo "cuobjdump not found" | tee "$out/sass_counts.txt"
fi

echo "== ncu (long workload, one launch)"
if command -v ncu > /dev/null; then
  # Only the metrics this ncu knows (an unknown name fails the whole run).
  known=$(timeout 15 ncu --query-metrics --chip gh100 2> /dev/null | awk '{print $1}')
  metrics=""
  for m in gpu__time_duration.sum \
    sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    sm__inst_executed_pipe_tensor_op_gmma.sum \
    sm__inst_executed_pipe_tensor_op_hmma.sum \
    sm__inst_executed_pipe_tensor.sum \
    sm__warps_active.avg.pct_of_peak_sustained_active \
    sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
    sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active \
    sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active \
    sm__throughput.avg.pct_of_peak_sustained_elapsed \
    lts__throughput.avg.pct_of_peak_sustained_elapsed \
    dram__throughput.avg.pct_of_peak_sustained_elapsed \
    smsp__warp_issue_stalled_barrier_per_warp_active.pct \
    smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct \
    smsp__warp_issue_stalled_wait_per_warp_active.pct \
    smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct \
    smsp__warp_issue_stalled_membar_per_warp_active.pct; do
    if [[ -z "$known" ]] || grep -qx "${m%%.*}" <<< "$known"; then metrics="$metrics${metrics:+,}$m"; fi
  done
  echo "metrics: $metrics" | tee "$out/ncu_metrics.txt"
  for k in sm90_overlap sm90; do
    if [[ $k == sm90 ]]; then regex='PagedPrefillSm90Kernel'; limit=30; else regex='PagedPrefillSm90OverlapKernel'; limit=50; fi
    timeout $limit ncu --clock-control none --metrics "$metrics" --section Occupancy \
      -k "regex:$regex" --launch-count 1 "$bench" --quick --kernel=$k --workload=long \
      > "$out/ncu_$k.log" 2>&1
    rc=$?
    if [[ $rc -ne 0 && $rc -ne 124 ]] && grep -qi "metric" "$out/ncu_$k.log"; then
      # A metric name this ncu rejects: the standard sections instead.
      mv "$out/ncu_$k.log" "$out/ncu_${k}_rejected.log"
      timeout $limit ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section Occupancy -k "regex:$regex" --launch-count 1 "$bench" --quick --kernel=$k --workload=long \
        > "$out/ncu_$k.log" 2>&1
      rc=$?
    fi
    echo "ncu exit code: $rc" | tee -a "$out/ncu_$k.log"
    grep -E "PagedPrefill|__|Achieved Occupancy|Theoretical Occupancy|Registers|ERROR" "$out/ncu_$k.log" | head -40
  done
else
  echo "ncu not found" | tee "$out/ncu_sm90_overlap.log"
fi

python3 - "$out" "$kernels" <<'PY' | tee "$out/summary.txt"
import os, re, sys
d, kernels = sys.argv[1], sys.argv[2].split()
def kv(line):
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}
print("## tests")
for name in ("tests_ladder.log", "tests_small.log", "tests_long.log"):
    p = os.path.join(d, name)
    if not os.path.exists(p): continue
    lines = open(p, errors="replace").read().splitlines()
    name_of = lambda l: l[13:].split(" (")[0].split(",")[0].strip()
    ok = [l for l in lines if l.startswith("[       OK ]")]
    bad, seen = [], set()
    for l in lines:  # gtest lists failed and skipped tests twice
        if (l.startswith("[  FAILED  ]") or l.startswith("[  SKIPPED ]")) and "/" in l and name_of(l) not in seen:
            seen.add(name_of(l))
            bad.append(l)
    code = [l for l in lines if "exit code" in l]
    print(f"{name}: {len(ok)} OK, {len(bad)} failed/skipped; {code[-1] if code else 'no exit code'}")
    for l in ok + bad: print("  " + l)
res, order = {}, []
for k in kernels:
    p = os.path.join(d, f"bench_{k}.log")
    if not os.path.exists(p): continue
    for line in open(p, errors="replace"):
        if line.startswith("RESULT kernel=prefill"):
            r = kv(line)
            key = (r["workload"], r["page_size"])
            if key not in res: order.append(key)
            res.setdefault(key, {})[k] = r
targets = {"long": 540, "batch": 480, "prefix": 420, "sweep_len512": 300}
print("\n## kernel bench (TFLOP/s; --quick, median of 5)")
print("| workload | ps | " + " | ".join(kernels) + " | target |")
print("|---|---|" + "---|" * len(kernels) + "---|")
for key in order:
    v = res[key]
    cells = [v[k]["tflops"] if k in v else "-" for k in kernels]
    print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + f" | {targets.get(key[0], '-')} |")
print("\n## SASS")
p = os.path.join(d, "sass_counts.txt")
if os.path.exists(p): print(open(p).read().strip())
for k in ("sm90_overlap", "sm90"):
    p = os.path.join(d, f"ncu_{k}.log")
    if not os.path.exists(p): continue
    print(f"\n## ncu, long, {k}")
    for line in open(p, errors="replace"):
        s = line.strip()
        if (re.match(r"^(gpu__|sm__|smsp__|lts__|dram__)", s) or "Occupancy" in s or "Pipe" in s or "Throughput" in s
                or "Duration" in s or "ERROR" in s or "exit code" in s):
            print("  " + re.sub(r"\s+", " ", s))
PY
exit $status
