# r2; r4 ran the same with a third binary (attnserve_decode_bench_v1 beside _base and the new one),
# decode_b64_sink added, bench/torch_decode_baselines.py --quick, and the kernel tests filtered as here
source .gpu/common.sh
st fp8_tests 200 $I/bin/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda*'
st decode_tests 120 $I/bin/attnserve_gpu_decode_tests
W=decode_b64,decode_b64_e4m3,decode_b64_e5m2,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3,decode_b64_cap,decode_b1,decode_b1_e4m3,spec_b64_q4,spec_b64_q4_e4m3
for pass in a b; do
  st bench_base_$pass 120 $I/bin/attnserve_decode_bench_base --quick --only=$W
  st bench_new_$pass 120 $I/bin/attnserve_decode_bench --quick --only=$W
done
st ncu8 200 ncu --kernel-name regex:PagedDecodeKernel --launch-skip 3 --launch-count 1 --set full --import-source no -f -o $O/l/ncu8 $I/bin/attnserve_decode_bench --only=decode_b64_e4m3
ncu -i $O/l/ncu8.ncu-rep --page details > $O/l/ncu8_details.txt 2>&1
ncu -i $O/l/ncu8.ncu-rep --page source --csv --print-source sass > $O/l/ncu8_source.csv 2>&1
st kernel_tests 200 $I/bin/attnserve_gpu_kernel_tests --gtest_filter='-Fp8Cuda*'
fin
