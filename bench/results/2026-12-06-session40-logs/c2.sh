# s40 c2: the FP8-query kernel after the fix of negative scales (the producer flipped Q's sign and
# the consumers flipped it again): the FP8 kernel tests, with each round's error against the
# rounded and the unrounded queries; two more passes of our bf16, FP8 and FP8-query prefill
# with PyTorch's baselines.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
st kt_fp8 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*'
grep -h "FP8_Q_ERROR\|PASSED\|FAILED\|OK \]\|Which is\|^round" $O/l/kt_fp8.log | tail -45
PW=long,batch,prefix,sweep_len512
for p in e f; do
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st kbq_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_fp8q --workload=$PW --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st torch_$p 90 python3 bench/torch_baselines.py --quick
done
fin
