source .gpu/common.sh
W=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3,decode_b64,decode_b256,x_b64_8k_e4m3
for v in mad oldwalk; do st dt_$v 120 $I/bin/dt_$v --gtest_filter='*Decode*:Fp8Cuda*'; tail -1 $O/l/dt_$v.log; done
cp $I/bin/attnserve_decode_bench $I/bin/db_new
for pass in a b c; do
  for v in old new mad oldwalk; do st db_${v}_$pass 150 $I/bin/db_$v --quick --only=$W; done
done
fin
