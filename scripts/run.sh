#!/usr/bin/env bash
# Sets everything up and starts a server: CUDA backend when a GPU is present,
# the CPU backend otherwise. Extra arguments go to attnserve.
#
# A build directory that already exists (scripts/test.sh's, say) keeps its
# configuration, tests included, and only the programs are brought up to
# date; a new one is configured without the tests, which builds faster.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
ATTNSERVE_TEST_DEPS=0 scripts/install_deps.sh
if [[ -f "$BUILD_DIR/CMakeCache.txt" ]]; then
  cmake --build "$BUILD_DIR" --target attnserve attnctl attnbench attnecho >/dev/null
else
  echo "run.sh: building into $BUILD_DIR/ (minutes the first time)" >&2
  BUILD_DIR=$BUILD_DIR scripts/build.sh -DATTNSERVE_TESTS=OFF >/dev/null
fi
exec "$BUILD_DIR/bin/attnserve" --backend=auto "$@"
