# s40 c1: the FP8-query kernel (sm90_fp8q: S = Q K^T in FP8 on K's stored E4M3 bytes, V still
# converted to fp16): the FP8 kernel tests (the new kernel against the float64 reference over
# the rounded queries, the existing FP8 kernels unchanged), its resource usage, then four passes
# each of our bf16 and FP8 sm90_overlap prefill, the new kernel, and PyTorch's prefill baselines;
# fp16 queries on both FP8 kernels once.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
st kt_fp8 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*'
grep -h "FP8_Q_ERROR\|PASSED\|FAILED\|OK \]" $O/l/kt_fp8.log | tail -40
for f in $I/lib/libattnserve*.so $B/attnserve_kernel_bench; do cuobjdump --dump-resource-usage $f 2>/dev/null; done > $O/l/resources.txt
grep -c "Lb1ELb1E" $O/l/resources.txt
PW=long,batch,prefix,sweep_len512
for p in a b c d; do
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st kbq_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_fp8q --workload=$PW --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st torch_$p 90 python3 bench/torch_baselines.py --quick
done
st kb8h 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
st kbqh 60 $B/attnserve_kernel_bench --quick --kernel=sm90_fp8q --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3 --q_dtype=fp16
grep -h "^RESULT" $O/l/kbq_a.log $O/l/kb8_a.log | head -30
fin
