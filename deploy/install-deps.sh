#!/bin/bash
# Installs the Debian 12 packages detattn builds and tests with, if any are missing.
# CUDA is optional: nvcc at /usr/local/cuda is used when present. clang (libFuzzer),
# openssl (test certificates), prometheus (promtool and a test server) and the python3
# packages serve the tests.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config
      libnng-dev libuv1-dev libprotobuf-c-dev protobuf-c-compiler
      check libsubunit-dev libxxhash-dev libcjson-dev libinih-dev libsystemd-dev gnuplot-nox
      clang libclang-rt-14-dev openssl prometheus
      python3 python3-numpy python3-torch python3-pytest python3-matplotlib python3-yaml)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
