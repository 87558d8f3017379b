# s45 c2 (one call for want of machines): the output through the tensor copy engine (`on`: each
# consumer warpgroup stores its normalised rows into its rows of the tile's Q buffer, one thread
# writes them out as boxes and releases the buffer once read; the producer loads the next tile's
# Q after block 1) against HEAD a02a06e (`head`) and `on` with the map disabled (`off`: stores
# from registers, the late Q release); then #34's closing table and the whole GPU suite.
source .gpu/common.sh
B=$I/bin
export ATTNSERVE_BIN=$I/bin/attnserve
export PYTHONPATH=$PWD/bench:$PWD/.gpu/site:$PWD/client/python PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, numpy, grpc; print("python", sys.version.split()[0], "torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), "numpy", numpy.__version__, "grpc", grpc.__version__)' 2>&1 | tee -a $O/l/device.txt
# correctness of `on` first: the Hopper prefill family and FP8
st kt_sm90 200 $B/attnserve_gpu_kernel_tests --gtest_filter='Families/PagedPrefillCuda.*/sm90_overlap:*Fp8Cuda*'
grep -h "PASSED\|FAILED\|Failure" $O/l/kt_sm90.log | tail -8
# HEAD's asserting TensorCopiesAndCpAsyncBothMatch (not run on a GPU before)
st kt_head 60 $B/kt_head --gtest_filter='*TensorCopiesAndCpAsyncBothMatch*'
PW=long,batch,prefix,sweep_len512,sweep_len1024,sweep_len2048
for p in a b c; do
  for v in head off; do st kb_${v}_$p 90 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64; done
  st kb_on_$p 90 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64
  st kb8_head_$p 90 $B/kb_head --quick --kernel=sm90_overlap --workload=long,batch,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st kb8_on_$p 90 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long,batch,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  [ $p != c ] && st torch_$p 90 python3 bench/torch_baselines.py --quick
done
for p in a b; do
  st decode_$p 120 $B/attnserve_decode_bench --quick --only=decode_b64,decode_b256,decode_b8_128k
  st torch_decode_$p 90 python3 bench/torch_decode_baselines.py --quick
done
st trace_head 60 $B/kb_head --quick --kernel=sm90_overlap --workload=batch,long --trace=132 --page_sizes=1,16
st trace_on 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=batch,long --trace=132 --page_sizes=1,16
st dtrace 120 $B/attnserve_decode_bench --quick --only=decode_b256,decode_b8_128k --trace --trace_dump=$O/l/dtrace.csv
st kt_rest 240 $B/attnserve_gpu_kernel_tests --gtest_filter='-Families/PagedPrefillCuda.*/sm90_overlap:*Fp8Cuda*'
st dt 120 $B/attnserve_gpu_decode_tests
st mla 120 $B/attnserve_gpu_mla_tests
st region 120 $B/attnserve_gpu_region_tests
st server 200 $B/attnserve_gpu_server_tests
grep -h "PASSED\|FAILED" $O/l/kt_*.log $O/l/dt.log $O/l/mla.log $O/l/region.log $O/l/server.log
cat $O/l/summary.txt
fin
