# sourced: unpack the install to /tmp/i, set env
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/i && (tar -C /tmp/i -xJf .gpu/inst.tar.xz 2>/dev/null || python3 -c "import tarfile;tarfile.open('.gpu/inst.tar.xz').extractall('/tmp/i')")
I=/tmp/i; O=${OUT:-/tmp/out}; mkdir -p $O/l
export LD_LIBRARY_PATH=$I/lib
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader | tee $O/l/device.txt
date -u | tee -a $O/l/device.txt
st() { local n=$1 s=$2; shift 2; local t0=$(date +%s); timeout $s "$@" > $O/l/$n.log 2>&1; local rc=$?; echo "STEP $n rc=$rc $(( $(date +%s)-t0 ))s" | tee -a $O/l/summary.txt; }
fin() { tar -C $O -czf $O/logs.tgz l; rm -rf $O/l; }
