#!/bin/bash
# The main job: installs what is missing, builds, starts detattnd on the CPU backend (the
# embedded default) with a small model on an ipc:// socket in a temporary directory, runs
# `detattn verify` against it from 8 concurrent clients, and stops the daemon.
# Usage: deploy/run.sh [extra detattn verify flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
build=build
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j "$(nproc)" --target detattnd detattn_cli detattn
bash deploy/install-python.sh "$build"
dir=$(mktemp -d)
url="ipc://$dir/detattnd.sock"
"$build/bin/detattnd" --listen "$url" --backend cpu --layers 4 --q-heads 8 --kv-heads 2 \
  --head-dim 128 --dtype bf16 --page-tokens 16 --kv-tokens 65536 --split-tokens 256 \
  2> "$dir/detattnd.log" &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do
  grep -q "listening on" "$dir/detattnd.log" && break
  kill -0 "$pid" 2>/dev/null || { cat "$dir/detattnd.log"; exit 1; }
  sleep 0.1
done
sed -n '1,20p' "$dir/detattnd.log"
"$build/bin/detattn" --url "$url" hello
"$build/bin/detattn" --url "$url" verify --clients 8 "$@"
