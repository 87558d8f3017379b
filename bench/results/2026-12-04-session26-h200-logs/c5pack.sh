# c5pack.sh: build-h200's final decode and kernel test binaries + /tmp/pvar/{pbase,mt4} prefill variants -> .gpu/inst.tar.xz
set -e
cd /work/main
rm -rf /tmp/gpuinst && mkdir -p /tmp/gpuinst/bin /tmp/gpuinst/lib
cp build-h200/bin/attnserve_gpu_decode_tests /tmp/gpuinst/bin/decode_tests
cp build-h200/bin/attnserve_gpu_kernel_tests /tmp/gpuinst/bin/kernel_tests
for v in pbase mt4; do cp /tmp/pvar/$v/attnserve_kernel_bench /tmp/gpuinst/bin/kb_$v; done
cp /tmp/pvar/mt4/attnserve_gpu_kernel_tests /tmp/gpuinst/bin/kt_mt4
for b in /tmp/gpuinst/bin/*; do ldd $b | awk '/=>/{print $3}'; done | sort -u | grep -v -E "libc\.so|libm\.so|libdl|librt|libpthread|libcuda\.|ld-linux" | xargs -I{} cp -L {} /tmp/gpuinst/lib/
tar -C /tmp/gpuinst -cJf .gpu/inst.tar.xz bin lib
cp bench/results/2026-12-04-session24-h200-logs/common.sh .gpu/common.sh
ls -la .gpu/inst.tar.xz
