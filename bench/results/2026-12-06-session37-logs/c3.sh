# s37 c3: the final host code on a GPU: the health service of our own (attnctl health, drains) and the
# edge and scale changes through the server-level GPU tests, the FlashInfer CUDA and FP8 pytest files,
# and test_edge_bounds (the health and metrics tests) against a CUDA server.
source .gpu/common.sh
B=$I/bin
export PYTHONPATH=$PWD/client/python:$PWD/examples:$PWD/tests/python:$PWD/bench:$PWD/.gpu/site PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
mkdir -p /work/main/build-h200/bin && ln -sf $B/attnserve /work/main/build-h200/bin/attnserve
st server 170 bash bench/run_server_gpu.sh $I $O/l/server /work/main/build-h200/bin/attnserve
ATTNSERVE_BIN=$B/attnserve st py_fi_cuda 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_cuda.py
ATTNSERVE_BIN=$B/attnserve st py_fp8 100 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_flashinfer_fp8.py
ATTNSERVE_BIN=$B/attnserve ATTNSERVE_TEST_BACKEND=cuda st py_edge 120 python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_edge_bounds.py -k "health or metrics or not_read or plans_hold"
grep -h "passed\|failed" $O/l/py_fi_cuda.log $O/l/py_fp8.log $O/l/py_edge.log | tail -6
tail -3 $O/l/server.log
fin
