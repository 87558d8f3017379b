#!/usr/bin/env bash
# Sets everything up on a fresh Debian 12 machine and runs every test:
# dependencies, build (CUDA backend compiled when nvcc is present), ctest.
# GPU tests report "skipped: no GPU" on a machine without one.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh -DATTNSERVE_TESTS=ON
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" --timeout 600
