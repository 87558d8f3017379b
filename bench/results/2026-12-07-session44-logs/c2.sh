# s44 c2: the sm90 consumers' softmax with each row's block maximum in interleaved chains (the
# profile of c1: a chain of 16 dependent FMNMX a row, 12% of all stall samples) instead of one
# chain; and the row sums alike. Variants (kernels/sm90/prefill.cu and prefill_fp8.cu recompiled,
# pvar9.sh): head0 = HEAD, c4 = four max chains (the same bits), c4s = four max and four sum
# chains (sums in another order), c2 = two max chains. Four passes interleaved, bf16 and FP8 E4M3;
# PyTorch's baselines in passes a and c; then the kernel tests on c4s.
source .gpu/common.sh
B=$I/bin
PW=long,batch,prefix,sweep_len512
for p in a b c d; do
  for v in head0 c4 c4s c2; do
    st kb16_${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16
    st kb8_${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
  if [ $p = a ] || [ $p = c ]; then st torch_$p 90 python3 bench/torch_baselines.py --quick; fi
done
grep -h "^RESULT" $O/l/kb16_head0_a.log | head -3
st kt_fp8 300 $B/kt_c4s --gtest_filter='*Fp8Cuda*'
grep -h "PASSED\|FAILED" $O/l/kt_fp8.log | tail -5
st kt_rest 300 $B/kt_c4s --gtest_filter='-*Fp8Cuda*'
grep -h "PASSED\|FAILED" $O/l/kt_rest.log | tail -5
cat $O/l/summary.txt
fin
