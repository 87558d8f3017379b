source .gpu/common.sh
st kernel_tests 200 $I/bin/attnserve_gpu_kernel_tests
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran" $O/l/kernel_tests.log | head -20
st decode_tests 60 $I/bin/attnserve_gpu_decode_tests
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran" $O/l/decode_tests.log | head
mkdir -p /work/main/build-h200/bin && ln -sf $I/bin/attnserve /work/main/build-h200/bin/attnserve && ln -sf $I/bin/cuda_region_holder /work/main/build-h200/bin/cuda_region_holder
st region_tests 60 $I/bin/attnserve_gpu_region_tests
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran" $O/l/region_tests.log | head
st server 200 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
grep -E "^\[  (PASSED|FAILED) |Failure|tests? ran|MISSING" $O/l/server/server_gpu_tests.txt $O/l/server.log | head -20
fin
