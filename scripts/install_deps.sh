#!/usr/bin/env bash
# Installs everything attnserve needs to build and test, from the
# distribution's packages (Debian 12 or Ubuntu 24.04). The one source of
# truth for the README, .ci/run and the Dockerfile's builder stage.
#
#   scripts/install_deps.sh           build + test dependencies
#   scripts/install_deps.sh --runtime only what the binaries need at run time
set -euo pipefail

runtime_only=0
[[ "${1:-}" == "--runtime" ]] && runtime_only=1

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

build_pkgs=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libssl-dev openssl curl python3
)
# python3-matplotlib: bench/plot.py (for Debian's /usr/bin/python3).
# python3-grpcio ... python3-pip: the Python client's tests (tests/python) and
# its offline install.
test_pkgs=(prometheus yamllint clang libclang-rt-14-dev libomp-14-dev python3-matplotlib
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-torch python3-venv
  python3-pip)
# kubectl (for `kubectl kustomize`) may already come from another package.
command -v kubectl >/dev/null 2>&1 || test_pkgs+=(kubernetes-client)
# Node.js (for offline Kubernetes schema validation) may come from elsewhere.
command -v npm >/dev/null 2>&1 || test_pkgs+=(nodejs npm)

if (( runtime_only )); then
  pkgs=(ca-certificates)
else
  pkgs=("${build_pkgs[@]}")
  if [[ "${ATTNSERVE_TEST_DEPS:-1}" == "1" ]]; then pkgs+=("${test_pkgs[@]}"); fi
fi

# Skip apt entirely when everything is already there (fast re-runs).
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} )); then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "install_deps: ${#pkgs[@]} packages present"
