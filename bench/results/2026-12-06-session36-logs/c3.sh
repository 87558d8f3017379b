# s36 c3: the final build: grains of 16 KiB on pages of 16 rows or more, 32 KiB below (c1 and c2's
# sweeps). The decode suite, the FP8 and variants suites, the server-level GPU tests (the backend's
# decode launch now says whether its batch splits); the A/B against the decode bench built at 053e7cf
# (_old), four passes alternating; PyTorch's decode baselines twice (c1 and c2's cuDNN figures differed
# by 5-9%); the traces of 8 x 128k.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
st decode_tests 150 $B/attnserve_gpu_decode_tests
st kt_fp8_var 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*:*VariantsCuda*'
W=decode_b64,decode_b256,decode_b8_128k,decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3
st torch_decode_a 90 python3 bench/torch_decode_baselines.py --quick
for p in a b c d; do
  st old_$p 90 $B/attnserve_decode_bench_old --quick --only=$W
  st new_$p 90 $B/attnserve_decode_bench --quick --only=$W
done
st torch_decode_b 90 python3 bench/torch_decode_baselines.py --quick
st trace 60 $B/attnserve_decode_bench --quick --trace --only=decode_b8_128k,decode_b8_128k_e4m3
grep -h "^TRACE" $O/l/trace.log
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
fin
