#!/usr/bin/env bash
# On a GPU machine: FP8 KV caches (issue #32). `tests` runs the FP8 GPU
# tests (Fp8Cuda*, Fp8CudaBackend*: the decode family on FP8 pools, the
# prefill families' refusal, CudaBackend writes / reads / batches) and then
# the decode family's and the other kernel tests, to show nothing else moved;
# `bench` times the decode bench's bf16 and FP8 workloads in one run (the
# copy ceiling first) and PyTorch's bf16 decode baselines. Logs go to OUT.
#   bench/run_fp8_gpu.sh BIN_DIR OUT tests|bench|all
# BIN_DIR holds attnserve_gpu_kernel_tests, attnserve_gpu_decode_tests and
# attnserve_decode_bench (a build with -DATTNSERVE_SM90A_ONLY=ON will do).
set -u
bin=$(cd "$1" && pwd)
out=$2
what=$3
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/device.txt"
date -u | tee "$out/date.txt"

if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "== FP8 GPU tests"
  timeout 150 "$bin/attnserve_gpu_kernel_tests" --gtest_filter='Fp8Cuda*' > "$out/fp8_tests.txt" 2>&1
  echo "exit $?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK|Failure|error|Expected|Which is" "$out/fp8_tests.txt" | head -40
  echo "== decode family tests"
  timeout 90 "$bin/attnserve_gpu_decode_tests" > "$out/decode_tests.txt" 2>&1
  echo "exit $?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure" "$out/decode_tests.txt" | head -20
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "== decode bench: bf16 and FP8 in one run"
  timeout 150 "$bin/attnserve_decode_bench" --quick \
    --only=decode_b64,decode_b64_e4m3,decode_b64_e5m2,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3,decode_b1,decode_b1_e4m3,spec_b64_q4,spec_b64_q4_e4m3 \
    > "$out/decode_bench.txt" 2>&1
  echo "exit $?"; sed -n '/^copy ceiling/,$p' "$out/decode_bench.txt"
  echo "== PyTorch bf16 decode baselines"
  timeout 90 python3 bench/torch_decode_baselines.py --quick > "$out/torch_decode.txt" 2>&1
  echo "exit $?"; grep -E "^TORCH|^torch|ms" "$out/torch_decode.txt" | head -20
fi

if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "== the other kernel and backend tests (VariantsCuda, CudaBackend, ...)"
  timeout 140 "$bin/attnserve_gpu_kernel_tests" --gtest_filter='-Fp8Cuda*' > "$out/kernel_tests.txt" 2>&1
  echo "exit $?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure" "$out/kernel_tests.txt" | head -20
fi
