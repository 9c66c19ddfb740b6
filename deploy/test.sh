#!/bin/bash
# The test command: installs what is missing, builds everything (CUDA too when nvcc is
# present), and runs the whole suite. GPU tests (label gpu) skip where no device is.
# Usage: deploy/test.sh [build-dir]
# Environment: DETATTN_SANITIZE=ON builds with ASan+UBSan; DETATTN_CUDA=AUTO|ON|OFF;
# DETATTN_FAULT_INJECT=ON adds the allocation fault-injection tests (server/fault.c).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
build=${1:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDETATTN_SANITIZE="${DETATTN_SANITIZE:-OFF}" -DDETATTN_CUDA="${DETATTN_CUDA:-AUTO}" \
  -DDETATTN_FAULT_INJECT="${DETATTN_FAULT_INJECT:-OFF}" >/dev/null
cmake --build "$build" -j "$(nproc)"
# The Python package and the library it loads (not from a sanitizer build: Python could not
# load it).
[ "${DETATTN_SANITIZE:-OFF}" = ON ] || bash deploy/install-python.sh "$build"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" --timeout 600
