# s35 c4: does FP8 prefill's conversion compete with the softmax's exponentials? Traces (session 32/34)
# show the FP8 consumers' softmax phase 12% longer than bf16's (1,940 against 1,733 cycles a turn on
# long, page_size 16) while they wait less for K/V. Variants of the converters: b0 HEAD (the conversion
# instruction for every word), b1 every word by moving the bits into fp16's fields (integer and fp16
# pipes), b2 half the words each way. FP8 E4M3 at page_size 1 and 16, three passes alternating, bf16
# beside; the variants' FP8 kernel tests; traces of b0 and the better variant.
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512
for p in a b c; do
  for v in b0 b1 b2; do
    st kb8${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
  st kb16_$p 60 $B/kb_b0 --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
done
for v in b1 b2; do st kt_$v 150 $B/kt_$v --gtest_filter='Fp8Cuda*'; done
for v in b0 b1 b2; do
  st trace_$v 45 $B/kb_$v --quick --kernel=sm90_overlap --workload=long,batch --page_sizes=16 --kv_dtype=fp8_e4m3 --trace=132
done
fin
