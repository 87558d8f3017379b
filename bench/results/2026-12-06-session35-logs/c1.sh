# s35 c1: HEAD on whatever card comes. In order of value: sm90_overlap prefill on bf16 and FP8 E4M3 at
# page_size 1 / 16 / 64 (two passes alternating), PyTorch's prefill baselines, the decode bench with
# PyTorch's decode baselines; the host code not yet run on a GPU (server-level tests, FlashInfer FP8 and
# CUDA pytest files, test_edge_bounds against a CUDA server, CUDA-region suite, CUDA backend tests);
# ncu of decode 256 x 4k and 8 x 128k, ours and cuDNN's (#34's decode gap); two more prefill passes.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, grpc, google.protobuf as p, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "grpcio", grpc.__version__, "protobuf", p.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
kb() { st kb16_$1 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64
       st kb8_$1 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16,64 --kv_dtype=fp8_e4m3; }
kb a; kb b
st torch 150 python3 bench/torch_baselines.py --quick
st decode_a 120 $B/attnserve_decode_bench --quick --only=decode_b64,decode_b64_e4m3,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3
st torch_decode 90 python3 bench/torch_decode_baselines.py --quick
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 150 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
ATTNSERVE_BIN=$B/attnserve st py_fp8 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
ATTNSERVE_BIN=$B/attnserve ATTNSERVE_TEST_BACKEND=cuda st py_edge 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_edge_bounds.py -k "not_read or plans_hold"
CUDA_REGION_HOLDER_BIN=$B/cuda_region_holder st region_tests 60 $B/attnserve_gpu_region_tests
st kt_backend 150 $B/attnserve_gpu_kernel_tests --gtest_filter='CudaBackend*:Fp8CudaBackend*'
for w in decode_b256 decode_b8_128k; do
  st ncu_$w 90 ncu --kernel-name regex:PagedDecodeKernel --launch-skip 3 --launch-count 1 --set full --import-source no -f -o $O/l/ncu_$w $B/attnserve_decode_bench --only=$w
  ncu -i $O/l/ncu_$w.ncu-rep --page details > $O/l/ncu_${w}_details.txt 2>&1
  st ncut_$w 120 ncu --kernel-name regex:'(?i)(cudnn|sdpa|fmha|flash)' --launch-skip 2 --launch-count 1 --set full --import-source no -f -o $O/l/ncut_$w python3 bench/torch_decode_baselines.py --quick --only=$w
  ncu -i $O/l/ncut_$w.ncu-rep --page details > $O/l/ncut_${w}_details.txt 2>&1
  rm -f $O/l/*.ncu-rep
done
kb c; kb d
st decode_b 120 $B/attnserve_decode_bench --quick --only=decode_b64,decode_b64_e4m3,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3
fin
