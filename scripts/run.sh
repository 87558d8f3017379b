#!/usr/bin/env bash
# Sets everything up and starts a server: CUDA backend when a GPU is present,
# the CPU backend otherwise. Extra arguments go to attnserve.
set -euo pipefail
cd "$(dirname "$0")/.."
ATTNSERVE_TEST_DEPS=0 scripts/install_deps.sh
scripts/build.sh -DATTNSERVE_TESTS=OFF >/dev/null
exec "${BUILD_DIR:-build}/bin/attnserve" --backend=auto "$@"
