# s44 c9: 16-bit pools load by cp.async below kSm90TensorCopyMinMeanKv keys a row (c8's finding),
# on the full build: the sm90_overlap kernel tests (the new TensorCopiesAndCpAsyncBothMatch, and
# RandomRaggedBatches with half its batches as the server runs them), the server GPU tests, and
# the kernel bench (which now sets mean_kv_per_row as the server does) against fin, two passes.
source .gpu/common.sh
B=$I/bin
export ATTNSERVE_BIN=$I/bin/attnserve
st kt 200 $B/attnserve_gpu_kernel_tests --gtest_filter='Families/PagedPrefillCuda.*/sm90_overlap'
grep -h "TENSOR_COPIES\|PASSED\|FAILED\|Failure" $O/l/kt.log | tail -8
st server 200 $B/attnserve_gpu_server_tests
grep -h "PASSED\|FAILED" $O/l/server.log | tail -4
PW=long,batch,prefix,sweep_len256,sweep_len512,sweep_len1024,sweep_len2048,sweep_len4096
for p in a b; do
  st kb16_fin_$p 90 $B/kb_fin --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64
  st kb16_new_$p 90 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64
done
cat $O/l/summary.txt
fin
