set -e
cd /work/main/build-h200
mkdir -p $1
cc=$(ninja -t commands attnserve_decode_bench | grep "kernels/decode/decode_cuda.cu" | head -1 | sed -E 's/ -MD -MT [^ ]+ -MF [^ ]+//; s/ -o [^ ]+$//; s/ -c / -cubin /')
eval "$cc -o $1/decode.cubin"
