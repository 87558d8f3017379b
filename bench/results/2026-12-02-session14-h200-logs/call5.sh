set -u
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $O/device.txt
for pass in a b; do echo "== pass $pass"; timeout 120 .gpu/attnserve_mla_bench --only=decode_h16,decode_h16_16x32,decode_h16_16x32_2cta,decode_h128 2>&1 | grep RESULT | tee -a $O/bench_$pass.log; done
