# s44 c5 (run inline on the warm card after c4): the server GPU tests on the full build of the
# change, the test server pointed at the install's attnserve (c4 ran them without ATTNSERVE_BIN,
# and every test failed to start its server: exit 127).
source .gpu/common.sh; export ATTNSERVE_BIN=$I/bin/attnserve; st server 240 $I/bin/attnserve_gpu_server_tests; grep -h "PASSED\|FAILED\|tests ran" $O/l/server.log | tail -6; cat $O/l/summary.txt; fin
