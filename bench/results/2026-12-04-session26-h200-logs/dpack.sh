# dpack.sh V... : /tmp/dvar/V decode variants (db_V, dt_V) -> .gpu/inst.tar.xz, with session 24's common.sh as .gpu/common.sh
set -e
cd /work/main
rm -rf /tmp/gpuinst && mkdir -p /tmp/gpuinst/bin /tmp/gpuinst/lib
for v in "$@"; do cp /tmp/dvar/$v/attnserve_decode_bench /tmp/gpuinst/bin/db_$v; cp /tmp/dvar/$v/attnserve_gpu_kernel_tests /tmp/gpuinst/bin/dt_$v; done
for b in /tmp/gpuinst/bin/*; do ldd $b | awk '/=>/{print $3}'; done | sort -u | grep -v -E "libc\.so|libm\.so|libdl|librt|libpthread|libcuda\.|ld-linux" | xargs -I{} cp -L {} /tmp/gpuinst/lib/
mkdir -p .gpu
tar -C /tmp/gpuinst -cJf .gpu/inst.tar.xz bin lib
cp bench/results/2026-12-04-session24-h200-logs/common.sh .gpu/common.sh
ls -la .gpu/inst.tar.xz
