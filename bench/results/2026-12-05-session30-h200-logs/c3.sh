# s30 c3: `new` = the tree: LogitTransform's finite multiplier (every family), the new
# VariantsCuda.ExtremeSoftCapsAndScalesOverZeroDotProducts, auto's sm90 threshold at 128 keys a row, and the
# sm90 FP8 producer's whole-block copies without the zero-fill operand; `ne3` = new without that last change
# (prefill_fp8.cu recompiled from the tree before it). Whole GPU kernel suite on new, memcheck of the sm90 FP8
# tests; FP8 A/B new vs ne3 (two passes, page_size 1 / 16, and 4); `auto` on bf16 (the router); decode on new.
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512,sweep_len256,sweep_len128
for p in a b; do
  st kb8_new_$p 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
  st kb8_ne3_$p 60 $B/kb_ne3 --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
done
st kb8_new_4 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=4 --kv_dtype=fp8_e4m3
st kb8_ne3_4 60 $B/kb_ne3 --quick --kernel=sm90_overlap --workload=$W --page_sizes=4 --kv_dtype=fp8_e4m3
st kb_auto16 60 $B/attnserve_kernel_bench --quick --workload=$W,sweep_len64 --page_sizes=1,16
st kb16_sm80 60 $B/attnserve_kernel_bench --quick --kernel=sm80 --workload=sweep_len256,sweep_len128,sweep_len64 --page_sizes=1,16
st kb16_sm90 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=sweep_len256,sweep_len128,sweep_len64 --page_sizes=1,16
st decode_new 120 $B/attnserve_decode_bench --quick --only=decode_b64,decode_b64_e4m3,decode_b256,decode_b256_e4m3,decode_b8_128k,decode_b8_128k_e4m3
st kt_new 240 $B/attnserve_gpu_kernel_tests
st memcheck_new 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/attnserve_gpu_kernel_tests --gtest_filter='Fp8Cuda.Sm90*'
fin
