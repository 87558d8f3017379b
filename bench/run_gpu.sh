#!/usr/bin/env bash
# Runs the GPU tests, the kernel benchmark and the PyTorch baselines on this
# machine's GPU, one after the other (never concurrently, so timings are not
# disturbed), and prints a compact table last.
#
# Usage: bench/run_gpu.sh [BIN_DIR] [LOG_DIR]
#   BIN_DIR holds attnserve_gpu_kernel_tests and attnserve_kernel_bench
#   (default build/bin; shared libraries they need may sit in BIN_DIR/lib).
#   LOG_DIR receives tests.log, bench.log, torch.log, nvidia-smi.txt
#   (default $OUT if set, else bench/results/logs).
set -u
BIN_DIR=${1:-build/bin}
LOG_DIR=${2:-${OUT:-bench/results/logs}}
mkdir -p "$LOG_DIR"
export LD_LIBRARY_PATH="$BIN_DIR/lib:${LD_LIBRARY_PATH:-}"
HERE=$(cd "$(dirname "$0")" && pwd)

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader \
  | tee "$LOG_DIR/nvidia-smi.txt"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /' || true

echo "== tests"
timeout ${TEST_TIMEOUT:-300} "$BIN_DIR/attnserve_gpu_kernel_tests" > "$LOG_DIR/tests.log" 2>&1
echo "tests exit code: $?" | tee -a "$LOG_DIR/tests.log"
grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|^\[==========\]|Failure|error" "$LOG_DIR/tests.log" | head -40

echo "== kernel bench"
timeout ${BENCH_TIMEOUT:-240} "$BIN_DIR/attnserve_kernel_bench" ${BENCH_ARGS:-} > "$LOG_DIR/bench.log" 2>&1
echo "bench exit code: $?" | tee -a "$LOG_DIR/bench.log"

echo "== torch baselines"
timeout ${TORCH_TIMEOUT:-200} python3 "$HERE/torch_baselines.py" ${TORCH_ARGS:-} > "$LOG_DIR/torch.log" 2>&1
echo "torch exit code: $?" | tee -a "$LOG_DIR/torch.log"
grep -E "^torch|failed" "$LOG_DIR/torch.log" | head -5

python3 - "$LOG_DIR" <<'PY'
import re, sys, os
d = sys.argv[1]
def kv(line):
    return dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
ours, torch_ = {}, {}
merge = []
for line in open(os.path.join(d, "bench.log")):
    if line.startswith("RESULT kernel=prefill"):
        r = kv(line); ours.setdefault(r["workload"], []).append(r)
    elif line.startswith("RESULT kernel=merge"):
        merge.append(kv(line))
if os.path.exists(os.path.join(d, "torch.log")):
    for line in open(os.path.join(d, "torch.log")):
        if line.startswith("TORCH"):
            r = kv(line); torch_[(r["workload"], r["backend"])] = r
print("\n| workload | ours ps=1 | ours ps=16 | cuDNN (dense) | FA2 (dense) | unit |")
print("|---|---|---|---|---|---|")
for w, rows in ours.items():
    unit = "ms" if w.startswith("decode") or "decode" in w else "TFLOP/s"
    def fmt(r):
        if r is None: return "-"
        return f'{float(r["ms"]):.3f}' if unit == "ms" else f'{float(r["tflops"]):.1f}'
    def best(ps):
        # The server's kernel choice with the default plan order.
        c = [r for r in rows if r["page_size"] == ps and r.get("section_mb", "16") == "16"]
        if not c: return None
        return min(c, key=lambda r: float(r["ms"]))
    b1, b16 = best("1"), best("16")
    v = f' ({b1["family"]})' if b1 else ""
    print(f"| {w} | {fmt(b1)}{v} | {fmt(b16)} | {fmt(torch_.get((w,'cudnn')))} | {fmt(torch_.get((w,'fa2')))} | {unit} |")
ab = {}
for w, rows in ours.items():
    for r in rows:
        if w in ("long", "batch", "prefix", "decode"):
            ab.setdefault((w, r["page_size"]), {})[(r["family"], r.get("section_mb", "-"))] = r
if ab:
    cfgs = sorted({c for v in ab.values() for c in v})
    print("\nA/B (TFLOP/s; decode ms), columns <kernel>/L2<section MiB>")
    print("| workload | ps | " + " | ".join(f"{v}/L2{m}" for v, m in cfgs) + " |")
    print("|---|---|" + "---|" * len(cfgs))
    for (w, ps), v in ab.items():
        cells = []
        for c in cfgs:
            r = v.get(c)
            cells.append("-" if r is None else (f'{float(r["ms"]):.3f}' if w == "decode" else r["tflops"]))
        print(f"| {w} | {ps} | " + " | ".join(cells) + " |")
for m in merge:
    print(f'| merge {m["tokens"]} tok x32x128, 2 states | {m["tbs"]} TB/s | {m["us"]} us | | | |')
PY
