#!/usr/bin/env bash
# The long fuzzing run, for a nightly job: both fuzz targets from the seed
# corpus plus a corpus kept between runs, each for a number of executions.
#
#   cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
#     -DATTNSERVE_CUDA=OFF -DATTNSERVE_SANITIZE=ON -DATTNSERVE_FUZZ=ON \
#     -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++
#   cmake --build build-asan
#   tests/fuzz/nightly.sh build-asan [RUNS] [CORPUS_DIR]
#
# RUNS defaults to 10,000,000 executions per target; CORPUS_DIR (default
# .fuzz-corpus) keeps what the fuzzers found interesting for the next night.
# Exits non-zero at the first crash, leak or sanitizer report, leaving the
# input as crash-* in the working directory. Prints each target's final
# stats (executions, executions per second).
set -euo pipefail
build=$1
runs=${2:-10000000}
corpus=${3:-.fuzz-corpus}
mkdir -p "$corpus/request" "$corpus/wire"
seeds=$(mktemp -d)
trap 'rm -rf "$seeds"' EXIT
"$build/bin/make_corpus" "$seeds"
for target in request wire; do
  echo "== ${target}_fuzz: $runs runs"
  "$build/bin/${target}_fuzz" -runs="$runs" -rss_limit_mb=4096 -timeout=20 \
    -print_final_stats=1 "$corpus/$target" "$seeds"
done
