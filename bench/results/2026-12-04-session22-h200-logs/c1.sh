source .gpu/common.sh
W=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3,decode_b64
for v in s3m3 s3m4; do st dt_$v 120 $I/bin/dt_$v --gtest_filter='*Decode*:Fp8Cuda*'; tail -3 $O/l/dt_$v.log; done
for pass in a b; do
  st db_base_$pass 150 $I/bin/attnserve_decode_bench --quick --only=$W
  for v in s3m3 s3m4; do st db_${v}_$pass 150 $I/bin/db_$v --quick --only=$W; done
done
for f in $O/l/db_*_a.log; do echo == $f; grep -A30 "^workload" $f; done
fin
