# s38 c1: HEAD's kernels against same-call PyTorch, interleaved: four passes, each running our decode
# bench (bf16 and FP8 E4M3, page_size 1 and 16), PyTorch's decode baselines (cuDNN, FA2), our sm90_overlap
# prefill (bf16 and FP8 E4M3, page_size 1, 16 and 64) and PyTorch's prefill baselines, one after another,
# so that neither side runs only at the start or the end of the call.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
DW=decode_b64,decode_b256,decode_b8_128k,decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3
PW=long,batch,prefix,sweep_len512
for p in a b c d; do
  st db_$p 90 $B/attnserve_decode_bench --quick --only=$DW
  st torch_decode_$p 90 python3 bench/torch_decode_baselines.py --quick --only=decode_b64,decode_b256,decode_b8_128k
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16,64 --kv_dtype=fp8_e4m3
  st torch_$p 90 python3 bench/torch_baselines.py --quick
done
fin
