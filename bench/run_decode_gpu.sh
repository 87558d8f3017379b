#!/usr/bin/env bash
# Runs the decode kernel family's GPU tests, its benchmark and the PyTorch
# SDPA baselines on this machine's GPU, one after the other (never
# concurrently), and prints a summary last. Under 4 minutes on an H200 (the
# three steps are capped at 120 + 90 + 60 s; expected about 1.5 minutes).
#
# Usage: bench/run_decode_gpu.sh INSTALL_DIR OUT_DIR
#   INSTALL_DIR: cmake --install build --prefix INSTALL_DIR --component decode_gpu
#     (bin/attnserve_gpu_decode_tests, bin/attnserve_decode_bench)
#   OUT_DIR receives device.txt, decode_tests.log, decode_bench.log,
#     torch_decode.log and summary.txt.
# Run from the repository root or anywhere: the torch script is found next to
# this file.
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

echo "== decode kernel tests"
timeout 120 "$inst/bin/attnserve_gpu_decode_tests" > "$out/decode_tests.log" 2>&1
rc=$?
echo "tests exit code: $rc" | tee -a "$out/decode_tests.log"
[[ $rc -ne 0 ]] && status=1
if grep -q "^\[  SKIPPED \]" "$out/decode_tests.log"; then
  echo "tests were SKIPPED (no GPU visible?)" | tee -a "$out/decode_tests.log"
  status=1
fi
grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|^\[       OK \]|^\[  FAILED  \]|Failure|error" "$out/decode_tests.log" | head -40

echo "== decode bench"
timeout 90 "$inst/bin/attnserve_decode_bench" ${DECODE_BENCH_ARGS:-} > "$out/decode_bench.log" 2>&1
rc=$?
echo "bench exit code: $rc" | tee -a "$out/decode_bench.log"
[[ $rc -ne 0 ]] && status=1

echo "== torch decode baselines"
timeout 60 python3 "$here/torch_decode_baselines.py" ${TORCH_ARGS:-} > "$out/torch_decode.log" 2>&1
rc=$?
echo "torch exit code: $rc" | tee -a "$out/torch_decode.log"
grep -E "^torch|failed" "$out/torch_decode.log" | head -5

python3 - "$out" <<'PY' | tee "$out/summary.txt"
import os, re, sys
d = sys.argv[1]
def kv(line):
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}
dec, pre, nos, torch_ = {}, {}, {}, {}
copy = None
for line in open(os.path.join(d, "decode_bench.log"), errors="replace"):
    if line.startswith("RESULT kernel=decode "):
        r = kv(line); dec[(r["workload"], r["page_size"])] = r
    elif line.startswith("RESULT kernel=decode_nosplit"):
        r = kv(line); nos[(r["workload"], r["page_size"])] = r
    elif line.startswith("RESULT kernel=prefill"):
        r = kv(line); k = (r["workload"], r["page_size"])
        if k not in pre or float(r["ms"]) < float(pre[k]["ms"]): pre[k] = r
    elif line.startswith("RESULT kernel=copy"):
        copy = kv(line)
tp = os.path.join(d, "torch_decode.log")
if os.path.exists(tp):
    for line in open(tp, errors="replace"):
        if line.startswith("TORCH"):
            r = kv(line); torch_[(r["workload"], r["backend"])] = r
if copy: print(f'copy ceiling (D2D 1 GiB, read+write): {float(copy["tbs"]):.2f} TB/s')
print("| workload | ps | decode ms | TB/s | merge share | chunk | items | unsplit ms | prefill ms (best variant) | cuDNN ms | flash ms |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
def ms(r): return "-" if r is None else f'{float(r["ms"]):.4f}'
for (w, ps), r in dec.items():
    p = pre.get((w, ps)); n = nos.get((w, ps))
    pv = "-" if p is None else f'{float(p["ms"]):.4f} (v{p["variant"]})'
    print(f'| {w} | {ps} | {float(r["ms"]):.4f} | {float(r["kv_tbs"]):.2f} | {100*float(r["merge_share"]):.1f}% | '
          f'{r["chunk"]} | {r["items"]} | {ms(n)} | {pv} | {ms(torch_.get((w, "cudnn")))} | {ms(torch_.get((w, "fa2")))} |')
PY
echo "== summary table of the bench"
sed -n '/^copy ceiling/,$p' "$out/decode_bench.log"
exit $status
