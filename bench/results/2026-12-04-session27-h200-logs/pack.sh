set -e
cd /work/main
rm -rf /tmp/gpuinst && mkdir -p /tmp/gpuinst/bin /tmp/gpuinst/lib
cp build-h200/bin/attnserve_gpu_kernel_tests /tmp/gpuinst/bin/kernel_tests
cp build-h200/bin/attnserve_kernel_bench /tmp/gpuinst/bin/kb_new
cp /tmp/wbase/build/bin/attnserve_kernel_bench /tmp/gpuinst/bin/kb_base
for b in /tmp/gpuinst/bin/*; do ldd $b | awk '/=>/{print $3}'; done | sort -u | grep -v -E "libc\.so|libm\.so|libdl|librt|libpthread|libcuda\.|ld-linux" | xargs -I{} cp -L {} /tmp/gpuinst/lib/
tar -C /tmp/gpuinst -cJf .gpu/inst.tar.xz bin lib
cp bench/results/2026-12-04-session24-h200-logs/common.sh .gpu/common.sh
cp /tmp/c1.sh .gpu/c1.sh
ls -la .gpu/inst.tar.xz
