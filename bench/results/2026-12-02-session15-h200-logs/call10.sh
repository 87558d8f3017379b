source .gpu/common.sh; $I/bin/attnserve_mla_bench --only=decode_h16,decode_h128 | grep RESULT | tee $O/l/bench_d.log; python3 bench/mla_torch.py 2>&1 | grep TORCH | tee $O/l/torch.log; fin
