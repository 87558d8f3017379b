source .gpu/common.sh
W=decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3
cp $I/bin/attnserve_decode_bench $I/bin/db_new
for pass in a b c; do
  for v in old new l2_128 l2_256; do st db_${v}_$pass 150 $I/bin/db_$v --quick --only=$W; done
done
fin
