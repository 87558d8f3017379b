# NOT RUN: no machine could be started for it (three tries), and the session's device time ran out.
# s45 c3: the landing build (HEAD a02a06e's kernels and server; this session's kernel change was
# not kept): on an H200, #34's table (bf16 prefill at page_size 1 / 16 / 64 against PyTorch's cuDNN
# and FA2; decode against PyTorch's decode baselines); on any card, the region tests with the
# client process they start, then the Hopper prefill and FP8 kernel tests.
source .gpu/common.sh
B=$I/bin
export ATTNSERVE_BIN=$I/bin/attnserve CUDA_REGION_HOLDER_BIN=$I/bin/cuda_region_holder
export PYTHONPATH=$PWD/bench:$PWD/.gpu/site:$PWD/client/python PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
if grep -q H200 $O/l/device.txt; then
  for p in a b; do
    st kb_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16,64
    st torch_$p 60 python3 bench/torch_baselines.py --quick
    st decode_$p 60 $B/attnserve_decode_bench --quick --only=decode_b64,decode_b256,decode_b8_128k
    st torch_decode_$p 60 python3 bench/torch_decode_baselines.py --quick
  done
fi
st region 40 $B/attnserve_gpu_region_tests
grep -h "PASSED\|FAILED" $O/l/region.log
st kt_sm90 120 $B/attnserve_gpu_kernel_tests --gtest_filter='Families/PagedPrefillCuda.*/sm90_overlap:*Fp8Cuda*'
grep -h "PASSED\|FAILED" $O/l/kt_sm90.log
cat $O/l/summary.txt
fin
