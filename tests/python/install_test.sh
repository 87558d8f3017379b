#!/usr/bin/env bash
# docs/python.md's install command, offline: a fresh venv that sees the
# system's grpcio/protobuf/numpy, `pip install ./client/python` with no index
# at all, then the installed package (not the source tree) imported and used;
# its version is the project's (CMakeLists.txt).
# Run from the repository root: tests/python/install_test.sh [PYTHON].
set -uo pipefail
python=${1:-/usr/bin/python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
check() {  # check NAME COMMAND...
  local name=$1; shift
  if "$@" >"$work/out" 2>&1; then passed=$((passed + 1)); echo "ok: $name"
  else failed=$((failed + 1)); echo "FAILED: $name"; cat "$work/out"; fi
}
version=$(sed -n 's/^project(attnserve VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
tree() { find client/python -name __pycache__ -prune -o -print | sort; }
tree >"$work/tree.before"
check "venv" "$python" -m venv --system-site-packages "$work/venv"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
check "pip install ./client/python (no index)" "$work/venv/bin/pip" install ./client/python
check "imports the installed copy" bash -c "cd '$work' && '$work/venv/bin/python' -c '
import attnserve, attnserve.v1.attention_pb2 as pb
assert attnserve.__file__.startswith(\"$work/venv/\"), attnserve.__file__
assert attnserve.__version__ == \"$version\", (attnserve.__version__, \"$version\")
assert pb.PrefillRequest(layer=3).layer == 3
print(attnserve.__file__)'"
check "metadata names the dependencies" bash -c \
  "'$work/venv/bin/pip' show attnserve | grep -q '^Requires: grpcio, numpy, protobuf'"
tree >"$work/tree.after"
check "no files written into the source tree" diff "$work/tree.before" "$work/tree.after"
check "editable install" "$work/venv/bin/pip" install -e ./client/python
check "editable imports the source tree" bash -c "cd '$work' && '$work/venv/bin/python' -c '
import attnserve, os; assert attnserve.__file__ == os.path.realpath(\"$PWD/client/python/attnserve/__init__.py\"), attnserve.__file__'"
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
