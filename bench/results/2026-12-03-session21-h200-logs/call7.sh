# s21 r7: PyTorch baselines (cuDNN, FA2 on dense bf16) beside one pass of the final code, FP8 and bf16.
source .gpu/common.sh
B=$I/bin
W=long,batch,prefix,sweep_len512
st f8_new 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16 --kv_dtype=fp8_e4m3
st bf_new 60 $B/attnserve_kernel_bench --quick --kernel=sm90_overlap --workload=$W --page_sizes=1,16
st torch 150 python3 bench/torch_baselines.py
fin
