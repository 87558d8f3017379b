#!/usr/bin/env bash
# --help and --version of every program (common/usage.cc). For each of
# attnserve, attnctl, attnbench, attnecho, tcp_echo and cluster_decode_bench:
#   --help, -h and --helpfull exit 0; --help has one line per flag that the
#   program's own sources define (read here from their ABSL_FLAGs, not from
#   the binary), with its default and a meaning, and no other flag lines;
#   --helpfull adds Abseil's (--flagfile);
#   no output names the source or build directory;
#   --version exits 0 and prints "NAME VERSION (commit HASH)" with CMake's
#   project version and a commit of this repository ("unknown" outside git);
#   an unknown flag exits 2, as every flag error does (docs/operations.md).
# Env: SOURCE_DIR, BUILD_DIR, VERSION, and ATTNSERVE, ATTNCTL, ATTNBENCH, ATTNECHO, TCP_ECHO,
# CLUSTER_DECODE_BENCH.
set -uo pipefail
source "$SOURCE_DIR/tests/ops/lib.sh"  # check, finish
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# Flag names defined with ABSL_FLAG in the given sources (repository paths).
own_flags() {
  for f in "$@"; do
    grep -ozP 'ABSL_FLAG\(\s*[\w:]+\s*,\s*\K\w+' "$SOURCE_DIR/$f" | tr '\0' '\n'
  done | sort -u
}

# lists_flags HELP FLAG...: a line "  --FLAG=DEFAULT  meaning" for each.
lists_flags() {
  local help=$1 missing=()
  shift
  for flag in "$@"; do
    grep -Eq "^  --$flag=[^ ]*  +[^ ]" "$help" || missing+=("--$flag")
  done
  ((${#missing[@]} == 0)) || { echo "missing or without default and meaning: ${missing[*]}"; return 1; }
}

# flag_lines HELP: how many lines list a flag.
flag_lines() { grep -Ec '^  --[a-z0-9_]+=' "$1"; }

no_build_paths() {
  ! grep -F -e "$SOURCE_DIR" -e "$BUILD_DIR" "$@"
}

version_ok() {  # version_ok NAME FILE
  local line hash
  line=$(cat "$2")
  [[ "$line" =~ ^$1\ ${VERSION//./\\.}\ \(commit\ ([0-9a-f]{7,40}|unknown)\)$ ]] ||
    { echo "got '$line'"; return 1; }
  hash=${BASH_REMATCH[1]}
  [[ "$hash" == unknown ]] && ! git -C "$SOURCE_DIR" rev-parse HEAD >/dev/null 2>&1 && return 0
  git -C "$SOURCE_DIR" cat-file -e "$hash^{commit}" || { echo "$hash is not a commit here"; return 1; }
}

run() {  # run NAME BINARY SOURCES...
  local name=$1 bin=$2
  shift 2
  mapfile -t flags < <(own_flags "$@")
  check "$name: its sources define flags (${#flags[@]})" test "${#flags[@]}" -gt 0
  "$bin" --help >"$WORK/$name.help" 2>&1
  check "$name --help exits 0" test $? -eq 0
  check "$name --help lists every own flag with default and meaning" lists_flags "$WORK/$name.help" "${flags[@]}"
  check "$name --help lists no other flag" test "$(flag_lines "$WORK/$name.help")" -eq "${#flags[@]}"
  check "$name --help starts with the version line" grep -q "^$name $VERSION (commit " "$WORK/$name.help"
  "$bin" -h >"$WORK/$name.h" 2>&1
  check "$name -h exits 0 and prints --help's text" cmp -s "$WORK/$name.h" "$WORK/$name.help"
  "$bin" --helpfull >"$WORK/$name.helpfull" 2>&1
  check "$name --helpfull exits 0" test $? -eq 0
  check "$name --helpfull lists own flags and Abseil's --flagfile" \
    lists_flags "$WORK/$name.helpfull" "${flags[@]}" flagfile
  "$bin" --version >"$WORK/$name.version" 2>&1
  check "$name --version exits 0" test $? -eq 0
  check "$name --version prints '$name $VERSION (commit HASH)'" version_ok "$name" "$WORK/$name.version"
  check "$name: no source or build path in any output" \
    no_build_paths "$WORK/$name.help" "$WORK/$name.helpfull" "$WORK/$name.version"
  "$bin" --no_such_flag >/dev/null 2>&1
  check "$name --no_such_flag exits 2 (a flag error)" test $? -eq 2
}

run attnserve "$ATTNSERVE" server/flags.cc
run attnctl "$ATTNCTL" client/attnctl.cc client/cli_flags.cc client/variant_flags.cc
run attnbench "$ATTNBENCH" client/attnbench.cc client/cli_flags.cc client/variant_flags.cc

# attnctl's counts out of range exit 2 naming the flag and the bound, before
# it connects (nothing listens on port 1) or allocates anything.
counts_refused() {  # counts_refused EXPECTED ARGS...
  local want=$1 out rc
  shift
  out=$("$ATTNCTL" --target=127.0.0.1:1 "$@" 2>&1)
  rc=$?
  [[ $rc -eq 2 && "$out" == *"$want"* ]] || { echo "rc=$rc: $out"; return 1; }
}
check "attnctl prefill --batch=-1 exits 2" counts_refused "--batch = -1 out of range [1, 65536]" prefill --batch=-1
check "attnctl prefill --q_len=-5 exits 2" counts_refused "--q_len = -5 out of range [0, 65536]" prefill --q_len=-5
check "attnctl prefill --kv_len=-5 exits 2" counts_refused "--kv_len = -5 out of range" prefill --kv_len=-5
check "attnctl prefill --batch x --q_len bounded" counts_refused "--batch x --q_len (query rows at most) = 262144" \
  prefill --batch=4096 --q_len=64
check "attnctl merge --states=-2 exits 2" counts_refused "--states = -2 out of range [1, 256]" merge --states=-2
check "attnctl merge --n=-1 exits 2" counts_refused "--n = -1 out of range [1, 65536]" merge --n=-1
check "attnctl merge --n=0 exits 2 (no rows to merge)" counts_refused "--n = 0 out of range [1, 65536]" merge --n=0
# Page ids and slots are checked before attnctl connects: a page id past
# int32 is refused, not wrapped to another page.
check "attnctl free 2^32 exits 2" counts_refused "PAGE 4294967296 (argument 2) out of range [0, 2147483647]" \
  free 0 4294967296
check "attnctl free x exits 2" counts_refused "PAGE x (argument 1) is not an integer" free x
check "attnctl free -1 exits 2" counts_refused "argument -1 is negative" free -1
check "attnctl read --dequantize -5 exits 2 (a boolean flag takes no value)" counts_refused \
  "argument -5 is negative" read --dequantize -5
check "attnctl free without pages exits 2" counts_refused "usage: attnctl free PAGE..." free
check "attnctl write without slots exits 2" counts_refused "usage: attnctl write" write
check "attnctl read without slots exits 2" counts_refused "usage: attnctl read" read
check "attnctl read 2^63 exits 2" counts_refused "SLOT 9223372036854775808 (argument 1) is not an integer" \
  read 9223372036854775808
check "attnctl set-scales --k_scale=1, exits 2" counts_refused '--k_scale=1,: not a list of numbers' \
  set-scales --k_scale=1, --v_scale=1
check "attnctl set-scales --k_scale=1e40 exits 2 (beyond float32)" counts_refused \
  '--k_scale=1e40: 1e40 does not fit a float32' set-scales --k_scale=1e40 --v_scale=1
check "attnctl set-scales without --v_scale exits 2" counts_refused "usage: attnctl set-scales" set-scales --k_scale=1
check "attnctl unregister without names exits 2" counts_refused "usage: attnctl unregister NAME..." unregister
# Connection and attention flags that Connect or the request would refuse
# are flag errors too: exit 2 before connecting.
check "attnctl --timeout_s=-1 exits 2" counts_refused "--timeout_s=-1 must be finite and >= 0" --timeout_s=-1 info
check "attnctl --connect_timeout_s=nan exits 2" counts_refused "--connect_timeout_s=nan must be finite" \
  --connect_timeout_s=nan info
check "attnctl --grpc_args=foo exits 2" counts_refused "--grpc_args: 'foo' is not name=integer" --grpc_args=foo info
check "attnctl --sinks=, exits 2" counts_refused "--sinks=,: '' is not a number" --sinks=, prefill
check "attnctl --tls_cert without --tls_key exits 2" counts_refused "--tls_cert=/dev/null needs tls_key" \
  --tls --tls_cert=/dev/null alloc 2
# attnbench likewise, and its run's own bounds (an end time that would
# overflow, page counts past 32 bits, a scale it would ignore).
bench_refused() {  # bench_refused EXPECTED ARGS...
  local want=$1 out rc
  shift
  out=$("$ATTNBENCH" --target=127.0.0.1:1 "$@" 2>&1)
  rc=$?
  [[ $rc -eq 2 && "$out" == *"$want"* ]] || { echo "rc=$rc: $out"; return 1; }
}
check "attnbench --timeout_s=-1 exits 2" bench_refused "--timeout_s=-1 must be finite" --timeout_s=-1
check "attnbench --sinks=abc exits 2" bench_refused "--sinks=abc: 'abc' is not a number" --sinks=abc
check "attnbench --duration_s=1e10 exits 2" bench_refused "--duration_s at most 1e7 s" --duration_s=1e10 --requests=5
check "attnbench --duration_s=nan exits 2" bench_refused "--duration_s >= 0" --duration_s=nan
check "attnbench --rate=nan exits 2" bench_refused "--rate, --requests, --duration_s >= 0" --rate=nan
check "attnbench --kv_len=2147483640 exits 2" bench_refused "at most 16777216" --kv_len=2147483640
check "attnbench --kv_scale=-1 exits 2" bench_refused "--kv_scale=-1 must be finite and >= 0" --kv_scale=-1
check "attnbench --kv_scale=nan exits 2" bench_refused "--kv_scale=nan must be finite" --kv_scale=nan
run attnecho "$ATTNECHO" bench/attnecho.cc
run tcp_echo "$TCP_ECHO" bench/tcp_echo.cc
run cluster_decode_bench "$CLUSTER_DECODE_BENCH" bench/cluster_decode_bench.cc
finish
