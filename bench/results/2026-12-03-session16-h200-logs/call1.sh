source .gpu/common.sh
st bench 150 $I/bin/attnserve_decode_bench --quick --only=decode_b64,decode_b64_e4m3,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3
st ncu8 200 ncu --kernel-name regex:PagedDecodeKernel --launch-skip 3 --launch-count 1 --set full --import-source no -f -o $O/l/ncu8 $I/bin/attnserve_decode_bench --only=decode_b64_e4m3
ncu -i $O/l/ncu8.ncu-rep --page details > $O/l/ncu8_details.txt 2>&1
ncu -i $O/l/ncu8.ncu-rep --page source --csv --print-source sass > $O/l/ncu8_source.csv 2>&1
st ncu16 150 ncu --kernel-name regex:PagedDecodeKernel --launch-skip 3 --launch-count 1 --set full --import-source no -f -o $O/l/ncu16 $I/bin/attnserve_decode_bench --only=decode_b64
ncu -i $O/l/ncu16.ncu-rep --page details > $O/l/ncu16_details.txt 2>&1
fin
