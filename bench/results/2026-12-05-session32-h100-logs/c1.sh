# s32 c1: HEAD (sessions 30-31's host and client code on the GPU for the first time). Server-level GPU tests,
# the GPU kernel, decode, MLA and CUDA-region suites, the FlashInfer FP8 and CUDA pytest files against a
# CUDA-built server; then same-call benches: auto bf16 and sm90_overlap FP8 with PyTorch cuDNN/FA2, the
# decode bench with PyTorch's decode baselines; and per-phase traces (--trace) of bf16 and FP8 at page_size 1/16.
# e1: the producer converts bf16 Q tiles on FP8 pools where it issues tensor copies (page_size >= 8), the
# next tile's after this tile's blocks are issued (prefill_fp8.cu recompiled alone): A/B against HEAD at
# page_size 1 (unchanged kernel, a control), 16 and 64, FP8 tests and traces on e1.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, grpc, google.protobuf as p, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "grpcio", grpc.__version__, "protobuf", p.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
for p in a b; do
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --workload=$W --page_sizes=1,16
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
for p in a b; do
  st kb8h_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=16,64 --kv_dtype=fp8_e4m3
  st kb8e1_$p 60 $B/kb_e1 --quick --kernel=sm90_overlap --workload=$W --page_sizes=16,64 --kv_dtype=fp8_e4m3
done
st kb8e1_ps1 60 $B/kb_e1 --quick --kernel=sm90_overlap --workload=$W --page_sizes=1 --kv_dtype=fp8_e4m3
st kt_e1 240 $B/kt_e1 --gtest_filter='Fp8Cuda*:VariantsCuda*'
st trace8e1 60 $B/kb_e1 --quick --kernel=sm90_overlap --workload=long,batch,sweep_len512 --page_sizes=16 --kv_dtype=fp8_e4m3 --trace=132
st torch 200 python3 bench/torch_baselines.py --quick
st decode_bench 150 $B/attnserve_decode_bench --quick --only=decode_b64,decode_b64_e4m3,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3
st torch_decode 90 python3 bench/torch_decode_baselines.py --quick
st trace16 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long,batch --page_sizes=1,16 --trace=132
st trace8 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long,batch --page_sizes=1,16 --kv_dtype=fp8_e4m3 --trace=132
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 90 $B/attnserve_gpu_region_tests
ATTNSERVE_BIN=$B/attnserve st py_fp8 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 150 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
st decode_tests 90 $B/attnserve_gpu_decode_tests
st mla_tests 90 $B/attnserve_gpu_mla_tests
st kernel_tests 240 $B/attnserve_gpu_kernel_tests
fin
