# s43 c2: HEAD's same-call table for #32 and #34: two passes interleaving our bf16 sm90_overlap,
# the default FP8 kernel (E4M3, bf16 queries), sm90_fp8q, PyTorch's prefill baselines; then
# decode (bf16 and E4M3) against PyTorch's decode baselines and the copy ceiling.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
PW=long,batch,prefix,sweep_len512
for p in a b; do
  st kb16_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16
  st kb8_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st kbq_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_fp8q --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st torch_$p 90 python3 bench/torch_baselines.py --quick
done
for p in a b; do
  st decode_$p 120 $B/attnserve_decode_bench --quick --only=decode_b64,decode_b64_e4m3,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3
  st torch_decode_$p 90 python3 bench/torch_decode_baselines.py --quick
done
grep -h "^RESULT" $O/l/kb8_a.log | head -10
cat $O/l/summary.txt
fin
