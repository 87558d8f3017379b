# pack.sh (sessions 37-40: EXTRA names more build-h200/bin binaries; each argument a /tmp/pvar variant whose kernel bench, decode bench and GPU kernel/decode tests go in as kb_V, db_V, dt_V, and with VTESTS=1 kt_V): install of build-h200 + GPU test/bench binaries + pytest site -> .gpu/inst.tar.xz
set -e
cd /work/main
rm -rf /tmp/gpuinst && cmake --install build-h200 --prefix /tmp/gpuinst > /dev/null
for b in $EXTRA attnserve_gpu_kernel_tests attnserve_gpu_decode_tests attnserve_gpu_server_tests attnserve_gpu_region_tests attnserve_gpu_mla_tests attnserve_kernel_bench attnserve_decode_bench cuda_region_holder; do cp build-h200/bin/$b /tmp/gpuinst/bin/; done
for v in "$@"; do cp /tmp/pvar/$v/attnserve_kernel_bench /tmp/gpuinst/bin/kb_$v; cp /tmp/pvar/$v/attnserve_decode_bench /tmp/gpuinst/bin/db_$v; [ -n "${VTESTS:-}" ] && cp /tmp/pvar/$v/attnserve_gpu_kernel_tests /tmp/gpuinst/bin/kt_$v; cp /tmp/pvar/$v/attnserve_gpu_decode_tests /tmp/gpuinst/bin/dt_$v; done
for b in /tmp/gpuinst/bin/*; do ldd $b 2>/dev/null | awk '/=>/{print $3}'; done | sort -u | grep -v -E "libc\.so|libm\.so|libdl|librt|libpthread|libcuda\.|ld-linux" | xargs -I{} cp -n -L {} /tmp/gpuinst/lib/ 2>/dev/null || true
tar -C /tmp/gpuinst -cJf .gpu/inst.tar.xz bin lib
if [ ! -d .gpu/site ]; then mkdir -p .gpu/site; for p in pytest _pytest pluggy iniconfig py py.py packaging; do cp -r /usr/lib/python3/dist-packages/$p .gpu/site/; done; fi
ls -la .gpu/inst.tar.xz; du -sh .gpu
