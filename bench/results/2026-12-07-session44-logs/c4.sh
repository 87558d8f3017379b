# s44 c4: the change as committed (four max chains in the plain 16-bit kernels; the FP8, soft-cap
# and sinks kernels keep one chain, ptxas output the same as HEAD's): the GPU kernel tests and the
# server GPU tests on the full build; then HEAD (head0) against it (fin) in three interleaved
# passes, bf16 and FP8 E4M3, page_size 1 and 16, with PyTorch's cuDNN and FA2 in each pass.
source .gpu/common.sh
B=$I/bin
python3 -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
PW=long,batch,prefix,sweep_len512
for p in a b c; do
  for v in head0 fin; do
    st kb16_${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16
    st kb8_${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
  st torch_$p 90 python3 bench/torch_baselines.py --quick
done
st kt_fp8 300 $B/attnserve_gpu_kernel_tests --gtest_filter='*Fp8Cuda*'
grep -h "PASSED\|FAILED" $O/l/kt_fp8.log | tail -5
st kt_rest 300 $B/attnserve_gpu_kernel_tests --gtest_filter='-*Fp8Cuda*'
grep -h "PASSED\|FAILED" $O/l/kt_rest.log | tail -5
st server 200 $B/attnserve_gpu_server_tests
grep -h "PASSED\|FAILED" $O/l/server.log | tail -5
cat $O/l/summary.txt
fin
