#!/usr/bin/env bash
# On a GPU machine: the attention variants (sliding window, soft-cap, sinks)
# in every kernel family. `tests` runs the kernel and backend tests (the
# VariantsCuda conformance suite among them) and the decode family's;
# `bench` times the anchors beside their variants (prefill: soft-cap 30,
# sinks, a 4k window over 32k keys; decode: a 128-key window over 32k keys
# against 128 keys, soft-cap and sinks against decode_b64) and PyTorch's
# cuDNN and FA2 on the dense anchors in the same run. Logs go to OUT.
#   bench/run_variants_gpu.sh INSTALL_DIR OUT tests|bench
# INSTALL_DIR: cmake --install build --prefix DIR, then again with
# --component sm90_gpu and --component decode_gpu (the test and bench
# binaries).
set -u
inst=$(cd "$1" && pwd)
out=$2
what=$3
mkdir -p "$out"
export LD_LIBRARY_PATH="$inst/lib"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"
date -u | tee "$out/date.txt"

if [ "$what" = tests ]; then
  echo "== variants conformance (every family)"
  timeout 240 "$inst/bin/attnserve_gpu_kernel_tests" --gtest_filter='*VariantsCuda*:CudaBackend*' \
    > "$out/variants_tests.txt" 2>&1
  echo "exit $?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|error" "$out/variants_tests.txt" | head -30
  echo "== the other kernel tests"
  timeout 150 "$inst/bin/attnserve_gpu_kernel_tests" --gtest_filter='-*VariantsCuda*:CudaBackend*' \
    > "$out/kernel_tests.txt" 2>&1
  echo "exit $?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure" "$out/kernel_tests.txt" | head -20
  echo "== decode family"
  timeout 90 "$inst/bin/attnserve_gpu_decode_tests" > "$out/decode_tests.txt" 2>&1
  echo "exit $?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure" "$out/decode_tests.txt" | head -20
fi

if [ "$what" = bench ]; then
  # Two passes; in each, the code before the variants (INSTALL_DIR/bin/
  # attnserve_kernel_bench_base, if there) on the anchors, then this code on
  # the anchors and their variants (sm90_overlap, the server's kernel for
  # these shapes).
  wl=long,long_cap,long_sink,batch,batch_cap,batch_sink,prefix,prefix_cap,prefix_sink,long32k,win4k_32k
  for pass in a b; do
    if [ -x "$inst/bin/attnserve_kernel_bench_base" ]; then
      timeout 100 "$inst/bin/attnserve_kernel_bench_base" --quick --kernel=sm90_overlap --workload=long,batch,prefix \
        --page_sizes=1,16 >> "$out/prefill_base.txt" 2>&1
    fi
    timeout 200 "$inst/bin/attnserve_kernel_bench" --quick --kernel=sm90_overlap --workload=$wl \
      --page_sizes=1,16 >> "$out/prefill_bench.txt" 2>&1
  done
  echo "== --kernel=auto picks (the server's heuristic)"
  timeout 100 "$inst/bin/attnserve_kernel_bench" --quick --workload=long,batch,prefix,win4k_32k --page_sizes=1 \
    >> "$out/prefill_bench.txt" 2>&1
  grep RESULT "$out/prefill_base.txt" 2>/dev/null | awk '{print "base", $3, $7, $8, $10, $11}'
  grep RESULT "$out/prefill_bench.txt" | awk '{print "new ", $3, $7, $8, $10, $11}'
  echo "== decode: variants"
  for w in decode_b64 win128_b64_32k decode_b64_128 decode_b64_cap decode_b64_sink; do
    timeout 60 "$inst/bin/attnserve_decode_bench" --quick --only=$w >> "$out/decode_bench.txt" 2>&1
  done
  grep "RESULT kernel=decode " "$out/decode_bench.txt" | awk '{print $3, $7, $8, $9, $10, $11}'
  echo "== PyTorch cuDNN and FA2 (dense anchors)"
  timeout 150 python3 bench/torch_baselines.py --quick > "$out/torch.txt" 2>&1
  echo "exit $?"; tail -12 "$out/torch.txt"
fi
