# pack.sh V...: install of build-h200 plus its test and bench binaries (and the region tests'
# client process, cuda_region_holder: set CUDA_REGION_HOLDER_BIN=$I/bin/cuda_region_holder) and,
# for each /tmp/pvar variant V, its kernel bench as kb_V (and its kernel tests as kt_V when KT
# names it) -> .gpu/inst.tar.xz. EXTRA adds more build-h200/bin binaries.
set -e
cd /work/main
rm -rf /tmp/gpuinst && cmake --install build-h200 --prefix /tmp/gpuinst > /dev/null
for b in attnserve_kernel_bench attnserve_decode_bench attnserve_gpu_kernel_tests attnserve_gpu_decode_tests \
         attnserve_gpu_mla_tests attnserve_gpu_region_tests cuda_region_holder attnserve_gpu_server_tests ${EXTRA:-}; do
  cp build-h200/bin/$b /tmp/gpuinst/bin/
done
for v in "$@"; do cp /tmp/pvar/$v/attnserve_kernel_bench /tmp/gpuinst/bin/kb_$v; done
for v in ${KT:-}; do cp /tmp/pvar/$v/attnserve_gpu_kernel_tests /tmp/gpuinst/bin/kt_$v; done
for b in /tmp/gpuinst/bin/*; do ldd $b 2>/dev/null | awk '/=>/{print $3}'; done | sort -u | grep -v -E "libc\.so|libm\.so|libdl|librt|libpthread|libcuda\.|ld-linux" | xargs -I{} cp -n -L {} /tmp/gpuinst/lib/ 2>/dev/null || true
tar -C /tmp/gpuinst -cJf .gpu/inst.tar.xz bin lib
ls -la .gpu/inst.tar.xz; du -sh .gpu
