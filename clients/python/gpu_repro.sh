#!/bin/bash
# On the GPU machine (the device tool): builds detattnd with the CUDA backend, starts it with
# the tiny model, and runs the reproducibility experiment with N samples (default 1000):
# detattn through the CUDA daemon against torch SDPA in-process on the GPU (torch 2.x picks
# flash or cuDNN). Writes $OUT/repro.json and $OUT/repro.png and prints the table.
# Usage: bash clients/python/gpu_repro.sh [N]   (carry .devdeps; see README "GPU")
set -euo pipefail
n=${1:-1000}
OUT=${OUT:-/tmp/detattn-gpu}
mkdir -p "$OUT"
eval "$(bash .devdeps/unpack.sh)"
sed -i 's|=/usr/|=/opt/devdeps/usr/|' /opt/devdeps/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc
cmake -S . -B build-gpu -G Ninja -DDETATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
  > "$OUT/configure.log" 2>&1
cmake --build build-gpu --target detattnd detattn -j16 > "$OUT/build.log" 2>&1
dir=$(mktemp -d)
build-gpu/bin/detattnd --listen "ipc://$dir/d.sock" --backend cuda --layers 2 --q-heads 4 --kv-heads 2 \
  --head-dim 64 --dtype bf16 --kv-tokens 262144 --split-tokens 256 2> "$OUT/detattnd.log" &
pid=$!
trap 'kill $pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 200); do grep -q "listening on" "$OUT/detattnd.log" && break; sleep 0.1; done
export DETATTN_LIBRARY=$PWD/build-gpu/lib/libdetattn.so PYTHONPATH=$PWD/clients/python
python3 -m detattn.repro --url "ipc://$dir/d.sock" --model tiny --samples "$n" --torch-device cuda \
  --time-limit "${REPRO_SECONDS:-240}" --json "$OUT/repro.json" --plot "$OUT/repro.png" | tee "$OUT/repro.md"
