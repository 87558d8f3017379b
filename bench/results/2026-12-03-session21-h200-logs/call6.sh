# s21 r6: the traced kernel with a stamp for Q landed before the consumers' conversion; the V scale read at the tile's start instead of in the epilogue (vs), A/B against the final code.
source .gpu/common.sh
B=$I/bin
st tests_vs 120 $B/tests_vs --gtest_filter='Fp8Cuda.Sm90*'
for k in fp8_e4m3 bf16; do
  st trace_$k 120 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=1,16 --kv_dtype=$k --trace=132
done
st trace_vs 120 $B/kb_vs --quick --kernel=sm90_overlap --workload=batch,sweep_len512 --page_sizes=16 --kv_dtype=fp8_e4m3 --trace=132
for pass in a b c; do
  st f8_new_$pass 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st f8_vs_$pass 60 $B/kb_vs --quick --kernel=sm90_overlap --workload=long,batch,prefix,sweep_len512 --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
fin
