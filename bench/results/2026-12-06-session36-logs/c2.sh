# s36 c2: shared chunks only in the launches that split (the kernel without them, DecodeLaunchOptions::split
# false, carries none of their code: c1's build cost unsplit launches up to 1.4%), and 16 KiB grains by
# default (c1's sweep). The decode suite (three runs a batch: served options; fixed chunks on the
# four-CTA FP8 kernel; the shared-chunk kernel on every batch, split or not, in grains of one step), the
# FP8 and variants suites; the A/B against the decode bench built at 053e7cf (_old), four passes
# alternating, with the grain sweep; PyTorch's decode baselines; traces of 8 x 128k.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
st decode_tests 150 $B/attnserve_gpu_decode_tests
st kt_fp8_var 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*:*VariantsCuda*'
W=decode_b64,decode_b256,decode_b8_128k,decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3
for p in a b c d; do
  st old_$p 90 $B/attnserve_decode_bench_old --quick --only=$W
  st new_$p 90 $B/attnserve_decode_bench --quick --only=$W
done
st torch_decode 90 python3 bench/torch_decode_baselines.py --quick
st trace 60 $B/attnserve_decode_bench --quick --trace --only=decode_b8_128k,decode_b8_128k_e4m3
grep -h "^TRACE" $O/l/trace.log
fin
