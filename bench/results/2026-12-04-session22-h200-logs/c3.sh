source .gpu/common.sh
W=decode_b64_e4m3,decode_b64_e5m2,decode_b256_e4m3,decode_b8_128k_e4m3,x_b64_2k_e4m3,x_b64_8k_e4m3,decode_b64,decode_b256,decode_b8_128k,x_b64_2k,x_b64_8k,spec_b64_q4_e4m3,spec_b64_q4,decode_b1_e4m3,decode_b1
st suite 300 $I/bin/attnserve_gpu_kernel_tests
tail -3 $O/l/suite.log
st memcheck 200 compute-sanitizer --tool memcheck $I/bin/attnserve_gpu_kernel_tests --gtest_filter='*Decode*:Fp8Cuda.*'
tail -3 $O/l/memcheck.log
for pass in a b c; do
  st db_old_$pass 150 $I/bin/db_old --quick --only=$W
  st db_new_$pass 150 $I/bin/attnserve_decode_bench --quick --only=$W
done
for f in $O/l/db_old_a.log $O/l/db_new_a.log; do echo == $f; grep -A30 "^workload" $f; done
cd $O/l
st ncu 300 ncu --set full --import-source no -k regex:PagedDecodeKernel --launch-skip 3 --launch-count 1 -o dec $I/bin/attnserve_decode_bench --quick --only=decode_b64_e4m3
st ncu_det 60 ncu -i dec.ncu-rep --page details --print-details all
st ncu_src 60 ncu -i dec.ncu-rep --page source --csv --print-source sass
rm -f dec.ncu-rep
cd -
fin
