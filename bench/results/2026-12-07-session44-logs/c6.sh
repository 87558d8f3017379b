# s44 c6: c4's A/B on an H200 (HEAD as head0 against the committed change as fin), three
# interleaved passes, bf16 and FP8 E4M3, page_size 1 and 16, PyTorch's cuDNN and FA2 in each pass.
source .gpu/common.sh
B=$I/bin
python3 -c 'import sys, torch, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "numpy", numpy.__version__)' | tee -a $O/l/device.txt
PW=long,batch,prefix,sweep_len512
for p in a b c; do
  for v in head0 fin; do
    st kb16_${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16
    st kb8_${v}_$p 60 $B/kb_$v --quick --kernel=sm90_overlap --workload=$PW --page_sizes=1,16 --kv_dtype=fp8_e4m3
  done
  st torch_$p 90 python3 bench/torch_baselines.py --quick
done
cat $O/l/summary.txt
fin
