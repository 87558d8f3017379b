source .gpu/common.sh; for p in a b c; do $I/bin/attnserve_mla_bench --only=decode_h16,decode_h128 | grep RESULT | tee -a $O/l/bench_$p.log; done; fin
