# session 23 call 7: bench/run_flashinfer_gpu.sh as committed, under MPS, default server flags
source .gpu/common.sh
export PYTHONPATH=$PWD/.gpu/site
MPS=1 bash bench/run_flashinfer_gpu.sh $I $O/l/fi > $O/l/fi-run.txt 2>&1
echo "rc $?" >> $O/l/fi-run.txt
pgrep -a nvidia-cuda-mps || echo "no mps process left" >> $O/l/fi-run.txt
cat $O/l/fi-run.txt | cut -c1-400
fin
