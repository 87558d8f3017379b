# cubin.sh OUTDIR: sm_90a cubins of kernels/sm90/prefill.cu and prefill_fp8.cu of the current tree
set -e
cd /work/main/build-h200
mkdir -p $1
for src in prefill prefill_fp8; do
  cc=$(ninja -t commands attnserve_kernel_bench | grep "kernels/sm90/$src.cu " | head -1 | sed -E 's/ -MD -MT [^ ]+ -MF [^ ]+//; s/ -o CMakeFiles[^ ]+//; s/ -c / -cubin /')
  eval "$cc -o $1/$src.cubin" &
done
wait
