# s34 c5: HEAD (host code of sessions 32-34, never run with a CUDA server) and three FP8 prefill variants,
# each kernels/sm90/prefill_fp8.cu recompiled alone (session 32's pvar8.sh):
#   e2  = -DATTNSERVE_SM90_EARLY_Q=1 (e2_early_q.patch: consumers convert the next tile's Q in the last turn)
#   e3  = -DATTNSERVE_SM90_EARLY_VSCALE=1 (e3_early_vscale.patch: V's scale loaded at the tile's start)
#   e23 = both.
# Order by value (logs land in $OUT/l as they go; the call may be cut at 600 s):
#  1. A/B HEAD vs e2 / e3 / e23, FP8 at page_size 1, 16, 64, two passes alternating; bf16 HEAD beside.
#  2. e23's FP8 and variant kernel tests (covers e2's and e3's code); traces of HEAD, e2, e3.
#  3. Server-level GPU tests, FlashInfer FP8 / CUDA pytest files, test_edge_bounds' unsent-responses tests,
#     CUDA-region suite, PyTorch's prefill baselines, CUDA backend tests (c6.sh: these alone).
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
for p in a b; do
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  for v in e2 e3 e23; do
    st kb8${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  done
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --workload=$W --page_sizes=1,16
done
st kt_e23 200 $B/kt_e23 --gtest_filter='Fp8Cuda*:VariantsCuda*'
for v in h e2 e3; do
  bin=$B/kb_$v; [ $v = h ] && bin=$B/attnserve_kernel_bench
  st trace8$v 45 $bin --quick --kernel=sm90_overlap --workload=long,batch --page_sizes=16 --kv_dtype=fp8_e4m3 --trace=132
done
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
ATTNSERVE_BIN=$B/attnserve st py_fp8 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
ATTNSERVE_BIN=$B/attnserve ATTNSERVE_TEST_BACKEND=cuda st py_edge 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_edge_bounds.py -k "not_read or plans_hold"
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 60 $B/attnserve_gpu_region_tests
st torch 120 python3 bench/torch_baselines.py --quick
st kt_backend 150 $B/attnserve_gpu_kernel_tests --gtest_filter='CudaBackend*:Fp8CudaBackend*'
fin
