source .gpu/common.sh
st racecheck 240 compute-sanitizer --tool racecheck --error-exitcode=1 $I/bin/attnserve_gpu_mla_tests --gtest_filter='*H16Ps16DecodeBf16*:*H16Ps64PrefillBf16Variants*'
tail -4 $O/l/racecheck.log
fin
