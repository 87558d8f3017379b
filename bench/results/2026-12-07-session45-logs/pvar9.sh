# usage: pvar9.sh NAME "-D flags" -> /tmp/pvar/NAME/{attnserve_kernel_bench,attnserve_gpu_kernel_tests};
# recompiles kernels/sm90/prefill.cu and prefill_fp8.cu with the flags, links the two binaries
set -e
cd /work/main/build-h200
name=$1; flags=$2
mkdir -p /tmp/pvar/$name
objs=""
for f in prefill prefill_fp8; do
  o=/tmp/pvar/$name/$f.o
  cc=$(ninja -t commands attnserve_kernel_bench | grep "kernels/sm90/$f.cu " | head -1 | sed -E 's/ -MD -MT [^ ]+ -MF [^ ]+//; s/ -o CMakeFiles[^ ]+//')
  eval "$cc $flags -Xptxas -v -o $o" 2> /tmp/pvar/$name/ptxas_$f.txt
  objs="$objs $o"
done
for t in attnserve_kernel_bench attnserve_gpu_kernel_tests; do
  l=$(ninja -t commands $t | tail -1 | sed -E "s# -o bin/$t # $objs -o /tmp/pvar/$name/$t #")
  eval "$l"
done
ls /tmp/pvar/$name
