# s36 c1: shared chunks in the decode family (DecodeLaunchOptions::grain). The decode suite (every batch
# three times: served options, fixed chunks with the four-CTA FP8 kernel, grains of one step), the FP8
# and variants suites (both use the same runner), the server-level GPU tests; an A/B of the decode bench
# built at 053e7cf (_old) against this build, four passes alternating (the new bench also times every
# split plan at grains 0..16, and 256 x 4k in 2 and 4 shared chunks); PyTorch's decode baselines; the
# traced launches of 8 x 128k with shared chunks.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
st decode_tests 150 $B/attnserve_gpu_decode_tests
st kt_fp8_var 200 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda*:VariantsCuda*'
W=decode_b64,decode_b256,decode_b8_128k,decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3
for p in a b c d; do
  st old_$p 90 $B/attnserve_decode_bench_old --quick --only=$W
  st new_$p 90 $B/attnserve_decode_bench --quick --only=$W
done
st torch_decode 90 python3 bench/torch_decode_baselines.py --quick
st trace 60 $B/attnserve_decode_bench --quick --trace --only=decode_b8_128k,decode_b8_128k_e4m3
grep -h "^TRACE" $O/l/trace.log
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
for p in e f; do
  st old_$p 90 $B/attnserve_decode_bench_old --quick --only=$W
  st new_$p 90 $B/attnserve_decode_bench --quick --only=$W
done
fin
