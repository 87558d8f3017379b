# usage: pvar.sh NAME "-D flags" -> /tmp/pvar/NAME/{attnserve_kernel_bench,attnserve_gpu_kernel_tests}
set -e
cd /work/main/build-h200
name=$1; flags=$2
mkdir -p /tmp/pvar/$name
o=/tmp/pvar/$name/prefill.o
cc=$(ninja -t commands attnserve_kernel_bench | grep "kernels/sm90/prefill.cu " | head -1 | sed -E 's/ -MD -MT [^ ]+ -MF [^ ]+//; s/ -o CMakeFiles[^ ]+//')
eval "$cc $flags -Xptxas -v -o $o" 2> /tmp/pvar/$name/ptxas.txt
for t in attnserve_kernel_bench attnserve_gpu_kernel_tests; do
  l=$(ninja -t commands $t | tail -1 | sed -E "s# -o bin/$t # $o -o /tmp/pvar/$name/$t #")
  eval "$l"
done
ls /tmp/pvar/$name
