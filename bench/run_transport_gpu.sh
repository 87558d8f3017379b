#!/usr/bin/env bash
# On the GPU host: how tensors reach the server, every path in one run
# (docs/transport.md). Runs bench/transport.py against the install: tcp_echo
# (the raw TCP floor), attnecho and attnserve --backend=cuda with gRPC tuned
# and untuned, and attnserve with q, output and LSE in a POSIX shm region, for
# decode64 and a 128 MiB prefill; prints one table. About 3 minutes.
#   bench/run_transport_gpu.sh INSTALL_DIR OUT_DIR
# INSTALL_DIR is `cmake --install build --prefix DIR` (bin/ has tcp_echo,
# attnecho, attnserve, attnbench).
set -uo pipefail
if (($# != 2)); then
  echo "usage: $0 INSTALL_DIR OUT_DIR" >&2
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
# shm objects live in /dev/shm: report its size (a small one fails RegisterRegion's mmap).
df -h /dev/shm | tee -a "$out/device.txt"
timeout 290 python3 "$here/transport.py" "$inst" "$out" --backend=cuda 2>&1 | tee "$out/transport.log"
exit "${PIPESTATUS[0]}"
