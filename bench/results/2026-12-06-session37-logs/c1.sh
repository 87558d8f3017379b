# s37 c1: an L2 prefetch-size qualifier on every cp.async of the decode and sm90 prefill families
# (ATTNSERVE_CP_ASYNC_L2, bench/results/2026-12-06-session37-logs/var.sh: l000 = none, l128 = .L2::128B, l256 = .L2::256B; a KV row of one head is 256
# bytes at head_dim 128 bf16, and the page_size 1 prefill producer gathers each row by itself).
# Four passes alternating of the decode bench (bf16 and FP8 E4M3) and of sm90_overlap prefill (bf16 and
# FP8 E4M3, page_size 1 and 16); the l256 decode tests; PyTorch's decode and prefill baselines.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
python3 -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
st dt_l256 60 $B/dt_l256
DW=decode_b64,decode_b256,decode_b8_128k,decode_b64_e4m3,decode_b256_e4m3,decode_b8_128k_e4m3
PW=long,batch,prefix,sweep_len512
for p in a b c d; do
  for v in l000 l128 l256; do st db_${v}_$p 90 $B/db_$v --quick --only=$DW; done
  for v in l000 l128 l256; do
    k=$B/kb_$v
    st kb16_${v}_$p 60 $k --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16
    st kb8_${v}_$p 60 $k --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
done
st torch_decode 90 python3 bench/torch_decode_baselines.py --quick
st torch 150 python3 bench/torch_baselines.py --quick
fin
