# s30 c1: HEAD d6aa559 on the H200. sm90_overlap on bf16 and FP8 (two passes each) with PyTorch cuDNN/FA2
# in the same call; FP8 ablations of the converter (x_noconv: no conversion; x_nolds: no shared loads of
# the FP8 bytes; x_nostage: no FP8 copies and no shared loads; wrong results, timing only);
# decode bench with PyTorch decode baselines; the GPU kernel, decode, MLA and CUDA-region suites;
# memcheck of the FP8 and CUDA backend tests.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, grpc, google.protobuf as p, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "grpcio", grpc.__version__, "protobuf", p.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
W8=long,batch,prefix,sweep_len512
for p in a b; do
  st kb16_$p 120 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
  st kb8_$p 120 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  for x in x_noconv x_nolds x_nostage; do
    st ${x}_$p 60 $B/kb_$x --quick --kernel=sm90_overlap --workload=$W8 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
st kb_auto16 120 $B/attnserve_kernel_bench --quick --workload=$W --page_sizes=1,16
st torch 200 python3 bench/torch_baselines.py --quick
st decode_bench 150 $B/attnserve_decode_bench --quick --only=decode_b64,decode_b64_e4m3,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3
st torch_decode 90 python3 bench/torch_decode_baselines.py --quick
st kernel_tests 240 $B/attnserve_gpu_kernel_tests
st decode_tests 90 $B/attnserve_gpu_decode_tests
st mla_tests 90 $B/attnserve_gpu_mla_tests
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 90 $B/attnserve_gpu_region_tests
st memcheck 100 compute-sanitizer --tool memcheck --error-exitcode 9 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda.*:CudaBackend.*'
fin
