#!/usr/bin/env bash
# On the GPU host: how tensors reach the server, every path in one run
# (docs/transport.md). Runs bench/transport.py against the install: tcp_echo
# (the raw TCP floor), attnecho and attnserve --backend=cuda with gRPC tuned
# and untuned, and attnserve with q, output and LSE in a system region, for
# decode64 and a 128 MiB prefill, under two gRPC settings (tuned = the
# default, gRPC's defaults), decode also with a step plan, a server with
# --idle_spin_us and a client with --busy_poll, and the shm paths also
# through a request channel (attnbench --channel); prints the tables (latency,
# and where the time goes by stage). About 7-8 minutes, under 560 s in any case (each
# attnbench run first writes its clients' KV); bench/transport.py --no-echo
# --tuned-only runs the attnserve cases alone.
#   bench/run_transport_gpu.sh INSTALL_DIR OUT_DIR [BEFORE_INSTALL_DIR]
# INSTALL_DIR is `cmake --install build --prefix DIR` (bin/ has tcp_echo,
# attnecho, attnserve, attnbench). BEFORE_INSTALL_DIR, optional: another
# install (e.g. of the commit before a transport change) whose attnserve and
# attnbench run inline in the same run, for the code's before and after.
set -uo pipefail
if (($# != 2 && $# != 3)); then
  echo "usage: $0 INSTALL_DIR OUT_DIR [BEFORE_INSTALL_DIR]" >&2
  exit 2
fi
inst=$(cd "$1" && pwd)
out=$2
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  nproc
  "$inst/bin/attnserve" --version
} 2>&1 | tee "$out/device.txt"
before=()
if (($# == 3)); then before=(--before="$(cd "$3" && pwd)"); fi
timeout 560 python3 "$here/transport.py" "$inst" "$out" --backend=cuda "${before[@]}" 2>&1 |
  tee "$out/transport.log"
exit "${PIPESTATUS[0]}"
