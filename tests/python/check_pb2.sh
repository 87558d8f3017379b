#!/usr/bin/env bash
# Checks that client/python/attnserve/v1/attention_pb2.py is what protoc
# generates from proto/attnserve/v1/attention.proto. Run from the repository
# root: tests/python/check_pb2.sh [PROTOC]. To regenerate after a proto change:
#   protoc --proto_path=proto --python_out=client/python attnserve/v1/attention.proto
set -euo pipefail
protoc=${1:-protoc}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$protoc" --proto_path=proto --python_out="$out" attnserve/v1/attention.proto
if cmp -s "$out/attnserve/v1/attention_pb2.py" client/python/attnserve/v1/attention_pb2.py; then
  echo "attention_pb2.py matches $("$protoc" --version)"
  echo "1 passed, 0 failed"
else
  diff "$out/attnserve/v1/attention_pb2.py" client/python/attnserve/v1/attention_pb2.py | head -20
  echo "attention_pb2.py is stale: regenerate it (see the top of this script)"
  echo "0 passed, 1 failed"
  exit 1
fi
