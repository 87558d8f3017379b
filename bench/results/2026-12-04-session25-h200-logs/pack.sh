# pack.sh V... : build-h200 kernel bench/tests/decode bench + /tmp/pvar/V variants (kb_V, kt_V) -> .gpu/inst.tar.xz
set -e
cd /work/main
rm -rf /tmp/gpuinst && mkdir -p /tmp/gpuinst/bin /tmp/gpuinst/lib
cp build-h200/bin/{attnserve_kernel_bench,attnserve_gpu_kernel_tests,attnserve_decode_bench} /tmp/gpuinst/bin/
for v in "$@"; do cp /tmp/pvar/$v/attnserve_kernel_bench /tmp/gpuinst/bin/kb_$v; cp /tmp/pvar/$v/attnserve_gpu_kernel_tests /tmp/gpuinst/bin/kt_$v; done
for b in /tmp/gpuinst/bin/*; do ldd $b | awk '/=>/{print $3}'; done | sort -u | grep -v -E "libc\.so|libm\.so|libdl|librt|libpthread|libcuda\.|ld-linux" | xargs -I{} cp -L {} /tmp/gpuinst/lib/
mkdir -p .gpu
tar -C /tmp/gpuinst -cJf .gpu/inst.tar.xz bin lib
ls -la .gpu/inst.tar.xz
