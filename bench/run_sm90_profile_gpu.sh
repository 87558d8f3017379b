#!/usr/bin/env bash
# Where the Hopper prefill kernel's warps wait: one launch of the `long`
# workload (1 x 16k causal, page_size 1) of a prefill kernel under ncu with
# warp-state statistics and source counters (per-instruction stall
# sampling), then the SASS instructions with the most stall samples and the
# stall reasons of the whole launch. About a minute on an H200.
#
# Usage: bench/run_sm90_profile_gpu.sh INSTALL_DIR OUT_DIR [KERNEL]
#   INSTALL_DIR: cmake --install build --prefix INSTALL_DIR --component sm90_gpu
#     (bin/attnserve_kernel_bench)
#   KERNEL: sm90_overlap (default), sm90, sm90_overlap_nopp or sm80
#   OUT_DIR receives profile.ncu-rep, details.txt, source.csv and top_stalls.txt.
set -u
if [[ $# -lt 2 ]]; then
  echo "usage: $0 INSTALL_DIR OUT_DIR [KERNEL]" >&2
  exit 2
fi
inst=$(cd "$1" && pwd)
out=$2
kernel=${3:-sm90_overlap}
mkdir -p "$out"
export LD_LIBRARY_PATH="$inst/lib:${LD_LIBRARY_PATH:-}"
case $kernel in
  sm90) regex='PagedPrefillSm90Kernel' ;;
  sm90_overlap | sm90_overlap_nopp) regex='PagedPrefillSm90OverlapKernel' ;;
  sm80) regex='PagedPrefill' ;;
  *) echo "unknown kernel $kernel" >&2; exit 2 ;;
esac
if ! command -v ncu > /dev/null; then
  echo "no ncu on this machine" >&2
  exit 1
fi
timeout 120 ncu --clock-control none --section WarpStateStats --section SourceCounters --section SpeedOfLight \
  --section Occupancy -k "regex:$regex" --launch-count 1 --import-source no -f -o "$out/profile" \
  "$inst/bin/attnserve_kernel_bench" --quick --kernel="$kernel" --workload=long > "$out/ncu_run.log" 2>&1
rc=$?
echo "ncu exit code: $rc"
[[ $rc -ne 0 ]] && { tail -20 "$out/ncu_run.log"; exit 1; }
ncu --import "$out/profile.ncu-rep" --print-details all > "$out/details.txt" 2>&1
ncu --import "$out/profile.ncu-rep" --page source --print-source sass --csv > "$out/source.csv" 2>&1
grep -E "Stall|stall|Warp Cycles|Duration|Throughput|Occupancy|Active Warps" "$out/details.txt" | head -60
python3 - "$out/source.csv" <<'PY' | tee "$out/top_stalls.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
head = next((i for i, r in enumerate(rows) if any("Warp Stall Sampling" in c for c in r)), None)
if head is None:
    print("no stall sampling columns; first lines:"); [print(",".join(r)[:200]) for r in rows[:5]]; sys.exit(0)
cols = rows[head]
body = [r for r in rows[head + 1:] if len(r) == len(cols)]
ai = next(i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (All"))
src = next((i for i, c in enumerate(cols) if c.lower() in ("source", "sass")), 1)
addr = next((i for i, c in enumerate(cols) if "Address" in c), 0)
def num(x):
    try: return float(x.replace(",", ""))
    except ValueError: return 0.0
total = sum(num(r[ai]) for r in body) or 1.0
print(f"columns: {cols}")
print(f"instructions: {len(body)}, stall samples: {total:.0f}")
order = sorted(range(len(body)), key=lambda i: -num(body[i][ai]))
for i in order[:40]:
    r = body[i]
    ctx = " | ".join(body[j][src].strip()[:60] for j in range(max(0, i - 2), i))
    print(f"{100 * num(r[ai]) / total:5.1f}%  {r[addr]:>8}  {r[src].strip()[:90]}    <- {ctx}")
PY
