# s36 c5: an experiment on 256 x 4k's last wave: the grid's last N items cut in two
# (DecodePlanOptions::tail_split, "decode_tail" lines, with each plan's largest output difference from
# the served plan's), bf16 and FP8 E4M3 at page_size 1 and 16, three passes; PyTorch's decode baselines.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
for p in a b c; do st tail_$p 120 $B/attnserve_decode_bench --quick --only=decode_b256,decode_b256_e4m3; done
st torch_decode 90 python3 bench/torch_decode_baselines.py --quick
grep -h "decode_tail\|kernel=decode " $O/l/tail_a.log | cut -c1-200
fin
