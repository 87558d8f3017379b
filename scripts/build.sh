#!/usr/bin/env bash
# Configures and builds attnserve into build/ (or $BUILD_DIR). The CUDA
# backend is compiled when nvcc is found (/usr/local/cuda/bin or PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cuda_flag=()
if [[ -n "${ATTNSERVE_CUDA:-}" ]]; then cuda_flag=(-DATTNSERVE_CUDA="${ATTNSERVE_CUDA}"); fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${cuda_flag[@]}" "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
