#!/usr/bin/env bash
# attnserve's exit codes, as docs/operations.md ("Exit codes") lists them:
# 2 for every flag error (an unknown flag, a value that does not parse or is
# out of range, a file a flag names that cannot be read, flags that
# contradict each other), 1 for a server that cannot start on this machine
# (a port in use), 0 after a drain. Each error names the flag, and no gRPC
# log line comes before it.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/ops/lib.sh"
WORK=$(mktemp -d)
trap 'stop_server; rm -rf "$WORK"' EXIT
small=(--backend=cpu --num_layers=1 --num_pages=16 --num_qo_heads=8 --num_kv_heads=2 --head_dim=64
       --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0)

# exits CODE NAME PATTERN ARGS...: attnserve ARGS exits CODE, printing
# PATTERN and no gRPC log line.
exits() {
  local code=$1 name=$2 pattern=$3
  shift 3
  timeout 120 "$ATTNSERVE" "$@" >"$WORK/out" 2>&1
  local rc=$?
  check "$name: exits $code" test $rc -eq "$code"
  check "$name: says '$pattern'" grep -q -- "$pattern" "$WORK/out"
  check "$name: no gRPC log line" bash -c '! grep -Eq "^[EIWD][0-9]{4} |chttp2_server" "$1"' _ "$WORK/out"
  [[ $rc -eq $code ]] || cat "$WORK/out"
}

exits 2 "--num_pages=abc" "num_pages" "${small[@]}" --num_pages=abc
exits 2 "unknown flag" "no_such_flag" "${small[@]}" --no_such_flag=1
exits 2 "--backend=gpu" "--backend=gpu must be auto, cuda or cpu" "${small[@]}" --backend=gpu
exits 2 "--head_dim=100" "--head_dim=100" "${small[@]}" --head_dim=100
exits 2 "--log_level=loud" "--log_level=loud must be" "${small[@]}" --log_level=loud
exits 2 "--drain_timeout_s=-1" "--drain_timeout_s=-1 must be at least 0" "${small[@]}" --drain_timeout_s=-1
exits 2 "--listen=nonsense" "--listen=nonsense: not HOST:PORT" "${small[@]}" --listen=nonsense
exits 2 "--listen=no-such-host.invalid:1" "--listen=no-such-host.invalid:1: host 'no-such-host.invalid' does not resolve" \
  "${small[@]}" --listen=no-such-host.invalid:1
exits 2 "--metrics_listen=127.0.0.1:99999" "--metrics_listen=127.0.0.1:99999: not HOST:PORT" \
  "${small[@]}" --metrics_listen=127.0.0.1:99999
exits 2 "--auth_tokens_file missing" "--auth_tokens_file=$WORK/none: cannot open" \
  "${small[@]}" --auth_tokens_file="$WORK/none"
exits 2 "--tls_cert missing" "--tls_cert=$WORK/none.pem: cannot open" \
  "${small[@]}" --tls_cert="$WORK/none.pem" --tls_key="$WORK/none.key"
exits 2 "--tls_cert without --tls_key" "--tls_cert and --tls_key must be given together" \
  "${small[@]}" --tls_cert="$WORK/none.pem"
exits 2 "--prefill_kernel=sm90 on the cpu backend" \
  "--prefill_kernel=sm90 selects a CUDA kernel family, but the backend is cpu" \
  "${small[@]}" --prefill_kernel=sm90
exits 2 "--prefill_kernel=sm90_fp8q on a bf16 cache" \
  "--prefill_kernel=sm90_fp8q needs --kv_dtype=fp8_e4m3 or fp8_e5m2" "${small[@]}" --prefill_kernel=sm90_fp8q
exits 2 "--prefill_kernel=sm90_fp8q at head_dim 64" "--prefill_kernel=sm90_fp8q needs --head_dim=128" \
  "${small[@]}" --prefill_kernel=sm90_fp8q --kv_dtype=fp8_e5m2
exits 2 "--prefill_kernel=sm90_fp8q on the cpu backend" \
  "--prefill_kernel=sm90_fp8q selects a CUDA kernel family, but the backend is cpu" \
  "${small[@]}" --prefill_kernel=sm90_fp8q --kv_dtype=fp8_e4m3 --head_dim=128
exits 2 "--prefill_kernel=sm91" "--prefill_kernel=sm91 must be auto, sm80, sm90 or sm90_fp8q" \
  "${small[@]}" --prefill_kernel=sm91
exits 2 "--flagfile missing" "flagfile" "${small[@]}" --flagfile="$WORK/none.flags"
exits 2 "--tls_client_ca without a certificate" "--tls_client_ca needs --tls_cert and --tls_key" \
  "${small[@]}" --tls_client_ca="$WORK/none.pem"
printf 'tok-a alice\n' >"$WORK/tokens"
exits 2 "--reflection=on with --auth_tokens_file" "--reflection=on with --auth_tokens_file: reflection answers callers without a token" \
  "${small[@]}" --auth_tokens_file="$WORK/tokens" --reflection=on
exits 2 "--reflection=maybe" "--reflection=maybe must be auto, on or off" "${small[@]}" --reflection=maybe
exits 2 "--grpc_args=foo" "--grpc_args: 'foo' is not name=integer" "${small[@]}" --grpc_args=foo
exits 2 "--grpc_args past an int" "grpc.max_concurrent_streams=4294967297' is out of range" \
  "${small[@]}" --grpc_args=grpc.max_concurrent_streams=4294967297
exits 2 "--kv_dtype=int8" "--kv_dtype=int8 must be bf16, fp16, fp8_e4m3 or fp8_e5m2" \
  "${small[@]}" --kv_dtype=int8
exits 2 "--q_dtype=fp16 with --kv_dtype=bf16" "--q_dtype=fp16 contradicts --kv_dtype=bf16" \
  "${small[@]}" --kv_dtype=bf16 --q_dtype=fp16
exits 2 "--q_dtype=fp32" "--q_dtype=fp32 must be bf16 or fp16" \
  "${small[@]}" --kv_dtype=fp8_e4m3 --q_dtype=fp32
mla=(--backend=cpu --num_layers=1 --num_pages=16 --attention=mla --listen=127.0.0.1:0
     --metrics_listen=127.0.0.1:0)
exits 2 "--attention=mha" "--attention=mha must be gqa or mla" "${small[@]}" --attention=mha
exits 2 "--kv_lora_rank=100" "--kv_lora_rank=100 must be a multiple of 16 in \[16, 1024\]" \
  "${mla[@]}" --kv_lora_rank=100
exits 2 "--qk_rope_head_dim=300" "--qk_rope_head_dim=300 must be a multiple of 16 in \[0, 256\]" \
  "${mla[@]}" --qk_rope_head_dim=300
exits 2 "--kv_lora_rank without --attention=mla" "--kv_lora_rank applies to --attention=mla only" \
  "${small[@]}" --kv_lora_rank=256
exits 2 "--num_kv_heads=2 with --attention=mla" "MLA has one latent KV head" \
  "${mla[@]}" --num_kv_heads=2
exits 2 "--head_dim=256 with --attention=mla" "--kv_lora_rank + --qk_rope_head_dim = 576" \
  "${mla[@]}" --head_dim=256
exits 2 "--kv_dtype=fp8_e4m3 with --attention=mla" "an MLA cache is bf16 or fp16 so far" \
  "${mla[@]}" --kv_dtype=fp8_e4m3
# The CUDA MLA family's widths, checked before any device is looked for (a
# build without the CUDA backend refuses --backend=cuda itself: "this build
# has no CUDA backend").
mla_cuda=("${mla[@]/--backend=cpu/--backend=cuda}")
exits 2 "--attention=mla with --backend=cuda and --kv_lora_rank=256" \
  "needs --kv_lora_rank=512 and --qk_rope_head_dim=64\|this build has no CUDA backend" \
  "${mla_cuda[@]}" --kv_lora_rank=256

# Values each within range whose product overflows, stray words, directories
# for files, a token listed twice, unusable TLS files, and addresses that
# would fail only once bound.
exits 2 "a cache past 2^50 bytes" "exceed the cache's bound of 2^50 bytes" --backend=cpu \
  --num_pages=536870912 --num_layers=1024 --page_size=128 --num_qo_heads=256 --num_kv_heads=256 \
  --head_dim=256 --listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0
exits 2 "a word that is not a flag" "unexpected argument 'num_pages=5'" "${small[@]}" num_pages=5
exits 2 "a directory as --auth_tokens_file" "--auth_tokens_file=$WORK: a directory, not a file" \
  "${small[@]}" --auth_tokens_file="$WORK"
exits 2 "a directory as --flagfile" "--flagfile=$WORK: a directory, not a file" \
  "${small[@]}" --flagfile="$WORK"
# A pipe is read as a file is (only a directory is refused).
start_server --flagfile=<(printf -- '--num_pages=17\n') || true
check "--flagfile from a pipe is read" grep -q "pages=17 " "$SERVER_LOG"
stop_server
printf 'tok-a alice\ntok-b bob\ntok-a bob\n' >"$WORK/tokens"
exits 2 "a token listed twice" "line 3: the token is listed before (for tenant 'alice')" \
  "${small[@]}" --auth_tokens_file="$WORK/tokens"
printf '# tokens\n\n' >"$WORK/no_tokens"
exits 2 "a token file without a token" "--auth_tokens_file=$WORK/no_tokens holds no token" \
  "${small[@]}" --auth_tokens_file="$WORK/no_tokens"
echo junk >"$WORK/junk.pem"
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$WORK/a.key" -out "$WORK/a.crt" -days 2 -subj /CN=localhost \
  >/dev/null 2>&1
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$WORK/b.key" -out "$WORK/b.crt" -days 2 -subj /CN=localhost \
  >/dev/null 2>&1
exits 2 "--tls_cert without a certificate" "--tls_cert=$WORK/junk.pem: holds no PEM certificate" \
  "${small[@]}" --tls_cert="$WORK/junk.pem" --tls_key="$WORK/a.key"
exits 2 "--tls_key of another certificate" "--tls_key=$WORK/b.key: is not the private key of the certificate" \
  "${small[@]}" --tls_cert="$WORK/a.crt" --tls_key="$WORK/b.key"
exits 2 "--tls_client_ca without a certificate" "--tls_client_ca=$WORK/junk.pem: holds no PEM certificate" \
  "${small[@]}" --tls_cert="$WORK/a.crt" --tls_key="$WORK/a.key" --tls_client_ca="$WORK/junk.pem"
exits 2 "--listen without a host" "--listen=:50051: no host" "${small[@]}" --listen=:50051
exits 2 "--metrics_listen on the --listen port" "name the same port" \
  "${small[@]}" --listen=127.0.0.1:50999 --metrics_listen=127.0.0.1:50999
exits 2 "an IPv6 --metrics_listen" "the metrics endpoint listens on IPv4 only" \
  "${small[@]}" --metrics_listen=[::1]:9999
exits 2 "--head_dim at its default with --attention=mla" "--head_dim=128 with --attention=mla" \
  "${mla[@]}" --head_dim=128
exits 2 "--region_socket without --allow_shared_memory" "needs --allow_shared_memory" \
  "${small[@]}" --region_socket=@attnserve-exit-test
exits 2 "--q_dtype=bogus on a 16-bit cache" "--q_dtype=bogus must be bf16 or fp16" "${small[@]}" --q_dtype=bogus
exits 2 "--num_kv_heads=-4" "--num_kv_heads=-4 out of range" "${small[@]}" --num_kv_heads=-4
exits 2 "--kv_lora_rank at its default without --attention=mla" "--kv_lora_rank applies to --attention=mla only" \
  "${small[@]}" --kv_lora_rank=512

start_server || { echo "0 passed, 1 failed"; exit 1; }
port=${GRPC_ADDR##*:}
taken=("${small[@]}" --listen="127.0.0.1:$port")
exits 1 "a taken --listen port" "the address is already in use" "${taken[@]}"
check "--help exits 0" "$ATTNSERVE" --help >/dev/null
check "--version exits 0" "$ATTNSERVE" --version >/dev/null
kill -TERM "$SERVER_PID"
wait "$SERVER_PID"
check "a drained server exits 0" test $? -eq 0
check "its start line says shared_memory and the KV cache's bytes" \
  grep -Eq "kv_cache_bytes=[0-9]+ \([0-9.]+ MiB\).* shared_memory=off" "$SERVER_LOG"
finish
