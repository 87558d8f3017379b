#!/usr/bin/env bash
# Runs request_fuzz, then wire_fuzz for half as long, from a fresh seed
# corpus for a bounded time (the long run is tests/fuzz/nightly.sh).
#   tests/fuzz/run.sh BUILD_DIR [SECONDS]
set -euo pipefail
build=$1
seconds=${2:-60}
corpus=$(mktemp -d)
trap 'rm -rf "$corpus"' EXIT
"$build/bin/make_corpus" "$corpus"
# -fork keeps going past an input that a sanitizer flags only if asked; we
# want the first failure to fail the run, so run in-process.
"$build/bin/request_fuzz" -max_total_time="$seconds" -rss_limit_mb=4096 -timeout=20 \
  -print_final_stats=1 "$corpus"
"$build/bin/wire_fuzz" -max_total_time="$(( seconds / 2 ))" -rss_limit_mb=4096 -timeout=20 \
  -print_final_stats=1 "$corpus"
