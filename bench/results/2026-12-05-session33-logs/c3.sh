# s33 c3: HEAD (host code of sessions 32-33, never run with a CUDA server) and e2 (consumers convert the
# next tile's bf16 Q rows during this tile's last turn, when its buffer has landed; prefill_fp8.cu recompiled
# alone with -DATTNSERVE_SM90_EARLY_Q=1, e2_early_q.patch).
# Order by value (the call may be cut at 600 s; logs land in $OUT/l as they go):
#  1. e2's FP8 and variant kernel tests; A/B HEAD vs e2 FP8 at page_size 1, 16, 64 (two passes, alternating),
#     bf16 HEAD beside them for FP8/bf16; traces of HEAD and e2.
#  2. Server-level GPU tests, FlashInfer FP8 / CUDA pytest files, CUDA backend tests, CUDA-region suite.
#  3. PyTorch cuDNN/FA2 prefill baselines; test_edge_bounds' unsent-responses tests against a CUDA server.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
st kt_e2 150 $B/kt_e2 --gtest_filter='Fp8Cuda*:VariantsCuda*'
for p in a b; do
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st kb8e2_$p 60 $B/kb_e2 --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --workload=$W --page_sizes=1,16
done
st trace8 45 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long,batch --page_sizes=16 --kv_dtype=fp8_e4m3 --trace=132
st trace8e2 45 $B/kb_e2 --quick --kernel=sm90_overlap --workload=long,batch --page_sizes=16 --kv_dtype=fp8_e4m3 --trace=132
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
ATTNSERVE_BIN=$B/attnserve st py_fp8 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
st kt_backend 100 $B/attnserve_gpu_kernel_tests --gtest_filter='CudaBackend*:Fp8CudaBackend*'
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 60 $B/attnserve_gpu_region_tests
st torch 120 python3 bench/torch_baselines.py --quick
ATTNSERVE_BIN=$B/attnserve ATTNSERVE_TEST_BACKEND=cuda st py_edge 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_edge_bounds.py -k "not_read or plans_hold"
fin
