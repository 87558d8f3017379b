# usage: dvar.sh NAME "-D flags" [SRC root] -> /tmp/dvar/NAME/{attnserve_decode_bench,attnserve_gpu_kernel_tests}
set -e
cd /work/main/build-h200
name=$1; flags=$2; src=${3:-/work/main}
mkdir -p /tmp/dvar/$name
o=/tmp/dvar/$name/decode_cuda.o
cc=$(ninja -t commands attnserve_decode_bench | grep "kernels/decode/decode_cuda.cu" | head -1 | sed -E 's/ -MD -MT [^ ]+ -MF [^ ]+//; s/ -o [^ ]+$//')
cc=${cc//\/work\/main/$src}
eval "$cc $flags -Xptxas -v -o $o" 2> /tmp/dvar/$name/ptxas.txt
for t in attnserve_decode_bench attnserve_gpu_kernel_tests; do
  l=$(ninja -t commands $t | tail -1 | sed -E "s# -o bin/$t # $o -o /tmp/dvar/$name/$t #")
  eval "$l"
done
ls /tmp/dvar/$name
