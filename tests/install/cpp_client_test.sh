#!/usr/bin/env bash
# The install tree as a consumer sees it: `cmake --install` into a temporary
# prefix, then move the tree (it must be relocatable); build
# examples/cpp_client as a fresh CMake project that finds only the moved tree
# (find_package(attnserve CONFIG), attnserve::client); run it against CPU
# servers started from the moved tree's bin/, once with bf16 and once with
# fp16 KV.
# Env: SOURCE_DIR, BUILD_DIR; EXAMPLE_CXX and EXAMPLE_CXX_FLAGS (the build's
# compiler and sanitizer flags, so that its static libraries link).
set -uo pipefail
source "$SOURCE_DIR/tests/ops/lib.sh"  # check, finish, start_server, stop_server, metric
WORK=$(mktemp -d)
trap 'stop_server; rm -rf "$WORK"' EXIT

cmake --install "$BUILD_DIR" --prefix "$WORK/staged" >"$WORK/install.log" 2>&1
check "cmake --install into a temporary prefix" test $? -eq 0
mv "$WORK/staged" "$WORK/prefix"
P=$WORK/prefix

installed() {
  local missing=()
  for f in bin/attnserve bin/attnctl bin/attnbench bin/attnecho bin/cluster_decode_bench \
    lib/libattnserve_client.a lib/libattnserve_common.a lib/libattnserve_reference.a \
    lib/libattnserve_proto.a \
    lib/cmake/attnserve/attnserveConfig.cmake lib/cmake/attnserve/attnserveConfigVersion.cmake \
    lib/cmake/attnserve/attnserveTargets.cmake include/attnserve/version.h \
    include/attnserve/client/client.h include/attnserve/client/workload.h \
    include/attnserve/common/kv_geometry.h include/attnserve/common/dtype.h \
    include/attnserve/common/reference.h \
    include/attnserve/v1/attention.proto include/attnserve/v1/attention.pb.h \
    include/attnserve/v1/attention.grpc.pb.h share/doc/attnserve/LICENSE; do
    [[ -f "$P/$f" ]] || missing+=("$f")
  done
  ((${#missing[@]} == 0)) || { echo "missing: ${missing[*]}"; return 1; }
}
check "the tree has bin/, lib/ (archives, CMake package), include/attnserve/, the LICENSE" installed
# An RPATH (not RUNPATH) of $ORIGIN/../lib on every program, and every
# library they load resolved from the moved tree or the system, none from
# the build tree.
rpath_ok() {
  local dynamic libs
  for b in "$P"/bin/*; do
    dynamic=$(readelf -d "$b") libs=$(ldd "$b")
    grep -q 'Library rpath: \[$ORIGIN/../lib\]' <<<"$dynamic" || { echo "$b: no RPATH \$ORIGIN/../lib"; return 1; }
    if grep -e "not found" -e "$BUILD_DIR" <<<"$libs"; then echo "$b"; return 1; fi
  done
}
check "programs: RPATH \$ORIGIN/../lib, every library found outside the build tree" rpath_ok
check "the moved attnserve runs" "$P/bin/attnserve" --version

cmake -S "$SOURCE_DIR/examples/cpp_client" -B "$WORK/example" -G Ninja \
  -DCMAKE_PREFIX_PATH="$P" -DCMAKE_CXX_COMPILER="${EXAMPLE_CXX:-c++}" \
  -DCMAKE_CXX_FLAGS="${EXAMPLE_CXX_FLAGS:-}" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
  >"$WORK/configure.log" 2>&1
check "examples/cpp_client configures: find_package(attnserve CONFIG) in the moved tree" \
  bash -c "test $? -eq 0 || { tail -20 '$WORK/configure.log'; exit 1; }"
cmake --build "$WORK/example" >"$WORK/build.log" 2>&1
check "examples/cpp_client builds and links attnserve::client" \
  bash -c "test $? -eq 0 || { tail -30 '$WORK/build.log'; exit 1; }"
check "the example compiles against the moved tree only (no -I of the source or build tree)" \
  bash -c "! grep -e '-I$SOURCE_DIR' -e '-isystem $SOURCE_DIR' -e '$BUILD_DIR' '$WORK/example/compile_commands.json'"

for dtype in bf16 fp16; do
  ATTNSERVE="$P/bin/attnserve" ATTNCTL="$P/bin/attnctl" start_server --kv_dtype=$dtype ||
    { echo "0 passed, 1 failed"; exit 1; }
  "$WORK/example/cpp_client" "$GRPC_ADDR" >"$WORK/run-$dtype.out" 2>&1
  rc=$?
  cat "$WORK/run-$dtype.out"
  check "$dtype: the example exits 0" test $rc -eq 0
  check "$dtype: its result matches float64" grep -q "against float64: .*: OK$" "$WORK/run-$dtype.out"
  check "$dtype: it reports the server's version and dtype" \
    grep -q "server [0-9.]* at $GRPC_ADDR, cpu backend, .*DTYPE_${dtype^^}$" "$WORK/run-$dtype.out"
  check "$dtype: it freed its pages" test "$(metric 'attnserve_kv_pages{state="used"}')" = 0
  stop_server
done

# The request channel example (docs/transport.md shows its middle part,
# which must be the program's text exactly).
ATTNSERVE="$P/bin/attnserve" ATTNCTL="$P/bin/attnctl" start_server --allow_shared_memory ||
  { echo "0 passed, 1 failed"; exit 1; }
"$WORK/example/cpp_channel" "$GRPC_ADDR" >"$WORK/run-channel.out" 2>&1
rc=$?
cat "$WORK/run-channel.out"
check "channel: the example exits 0" test $rc -eq 0
check "channel: its channel result equals the gRPC one" \
  grep -q "through channel [0-9]*: same bytes as over gRPC: OK$" "$WORK/run-channel.out"
check "channel: it closed its channel" test "$(metric 'attnserve_open_channels{tenant="default"}')" = 0
stop_server
check "docs/transport.md's channel example is examples/cpp_client/channel.cc's text" python3 - \
  "$SOURCE_DIR/docs/transport.md" "$SOURCE_DIR/examples/cpp_client/channel.cc" <<'PY'
import re, sys
doc, src = open(sys.argv[1]).read(), open(sys.argv[2]).read()
section = doc[doc.index("## Request channels"):]
block = re.search(r"```cpp\n(.*?)```", section, re.S).group(1)
start = "// --- the part docs/transport.md shows ---\n"
body = src[src.index(start) + len(start):src.index("  // --- end of the part")]
strip = lambda t: "\n".join(l[2:] if l.startswith("  ") else l for l in t.splitlines())
sys.exit(0 if strip(body).strip() == block.strip() else 1)
PY
finish
