# usage: var.sh NAME 'L2 qualifier' -> /tmp/pvar/NAME/{binaries}; recompiles the decode and sm90 prefill units with ATTNSERVE_CP_ASYNC_L2
set -e
cd /work/main/build-h200
name=$1; q=$2
d=/tmp/pvar/$name; mkdir -p $d
objs=""
for u in kernels/decode/decode_cuda.cu kernels/sm90/prefill.cu kernels/sm90/prefill_fp8.cu; do
  o=$d/$(basename $u).o
  cc=$(ninja -t commands attnserve_decode_bench | grep "$u " | head -1 | sed -E 's/ -MD -MT [^ ]+ -MF [^ ]+//; s/ -o CMakeFiles[^ ]+//')
  eval "$cc -DATTNSERVE_CP_ASYNC_L2='\"$q\"' -o $o" &
  objs="$objs $o"
done
wait
for t in attnserve_kernel_bench attnserve_decode_bench attnserve_gpu_kernel_tests attnserve_gpu_decode_tests; do
  l=$(ninja -t commands $t | tail -1 | sed -E "s# -o bin/$t # $objs -o $d/$t #")
  eval "$l"
done
ls -la $d
