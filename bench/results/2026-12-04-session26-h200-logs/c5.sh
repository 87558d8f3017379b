# s26 c5: the committed decode code's 16-bit decode suite (attnserve_gpu_decode_tests) and whole GPU kernel suite; the sm90 prefill's row maximum in four chains (mt4) against pbase (HEAD's prefill objects), two passes, bf16 and FP8; the sm90 prefill, variant and FP8 tests on mt4
source .gpu/common.sh
B=$I/bin
st decode_tests 200 $B/decode_tests
st kernel_tests 300 $B/kernel_tests
W=long,batch,prefix,sweep_len512,long_cap,batch_cap
for pass in a b; do
  for v in pbase mt4; do
    st kb_${v}_$pass 100 $B/kb_$v --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
    st kb8_${v}_$pass 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
st tests_mt4 200 $B/kt_mt4 --gtest_filter='*Sm90*:*PagedPrefillCuda*sm90*:*Variants*sm90*:Fp8Cuda.*'
fin
