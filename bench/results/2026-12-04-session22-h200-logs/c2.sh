source .gpu/common.sh
W=decode_b64_e4m3,decode_b256_e4m3,x_b64_2k_e4m3,x_b64_8k_e4m3,x_b64_16k_e4m3,x_b64_2k,decode_b64,x_b64_8k
for v in xsplit s6m2; do st dt_$v 120 $I/bin/dt_$v --gtest_filter='*Decode*:Fp8Cuda*'; tail -1 $O/l/dt_$v.log; done
for pass in a b; do
  st db_base_$pass 150 $I/bin/attnserve_decode_bench --quick --only=$W
  for v in xsplit s6m2; do st db_${v}_$pass 150 $I/bin/db_$v --quick --only=$W; done
done
for f in $O/l/db_*_a.log; do echo == $f; grep -A30 "^workload" $f; done
cd $O/l
st ncu 300 ncu --set full --import-source no -k regex:PagedDecodeKernel --launch-skip 3 --launch-count 1 -o dec $I/bin/attnserve_decode_bench --quick --only=decode_b64_e4m3
st ncu_det 60 ncu -i dec.ncu-rep --page details --print-details all
st ncu_src 60 ncu -i dec.ncu-rep --page source --csv --print-source sass
rm -f dec.ncu-rep
cd -
grep -E "Duration|DRAM Throughput|Issue Slots|Registers Per|Achieved Occ" $O/l/ncu_det.log | head -20
fin
