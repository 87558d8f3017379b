source .gpu/common.sh
W=decode_b64,decode_b256,decode_b8_128k,decode_b1,spec_b64_q4,decode_b64_cap,decode_b64_sink,win128_b64_32k,decode_b64_e4m3,decode_b64_e5m2,decode_b256_e4m3,decode_b8_128k_e4m3,decode_b1_e4m3,spec_b64_q4_e4m3,decode_b64_2k_e4m3,decode_b64_8k_e4m3,decode_b64_2k,decode_b64_8k
st suite 300 $I/bin/attnserve_gpu_kernel_tests
tail -3 $O/l/suite.log
st memcheck 200 compute-sanitizer --tool memcheck $I/bin/attnserve_gpu_kernel_tests --gtest_filter='*Decode*:Fp8Cuda.*'
tail -2 $O/l/memcheck.log
for pass in a b; do
  st db_old_$pass 150 $I/bin/db_old --quick --only=$(echo $W | sed "s/,decode_b64_2k_e4m3,decode_b64_8k_e4m3,decode_b64_2k,decode_b64_8k/,x_b64_2k_e4m3,x_b64_8k_e4m3,x_b64_2k,x_b64_8k/")
  st db_new_$pass 150 $I/bin/attnserve_decode_bench --quick --only=$W
done
st torch 120 python3 bench/torch_decode_baselines.py --quick
tail -12 $O/l/torch.log
grep -A40 "^workload" $O/l/db_new_a.log
fin
