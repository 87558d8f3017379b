source .gpu/common.sh
st mla_tests 200 $I/bin/attnserve_gpu_mla_tests
for pass in a b; do st mla_bench_$pass 90 $I/bin/attnserve_mla_bench --only=decode_h128,decode_h128_ps1,prefill_h128,decode_h128_64x32; grep RESULT $O/l/mla_bench_$pass.log; done
st prefill_racecheck 120 compute-sanitizer --tool racecheck --error-exitcode=1 $I/bin/attnserve_gpu_kernel_tests --gtest_filter='*CausalShift/sm90*'
st ncu 200 ncu --kernel-name regex:MlaSm90 --launch-skip 3 --launch-count 1 --set full --import-source no -f -o $O/l/mla_ncu $I/bin/attnserve_mla_bench --only=decode_h128
ncu -i $O/l/mla_ncu.ncu-rep --page details > $O/l/ncu_details.txt 2>&1
ncu -i $O/l/mla_ncu.ncu-rep --page source --csv --print-source sass > $O/l/ncu_source.csv 2>&1
fin
